"""`ddpkit bench collectives | scaling | tune`: measurements a user can paste into a decision.

    ddpkit bench collectives --nproc 2 --max-size 64MB      # time, algbw, busbw vs memcpy ceiling
    ddpkit bench scaling --workload gpt --max-nproc 2       # throughput, efficiency, comm share, plots
    ddpkit bench tune --workload mlp                        # try the options, recommend the fastest

Each subcommand parses its own options (`ddpkit bench tune --help`). Figures are medians over rounds
that interleave the configurations; the spread across rounds is printed next to every median.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ddpkit.errors import DdpkitError


def build_parser() -> argparse.ArgumentParser:
    from ddpkit.bench import collectives, scaling, tune

    parser = argparse.ArgumentParser(prog="ddpkit bench", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="bench", required=True)
    for name, module, summary in (
        ("collectives", collectives, "all_reduce/broadcast/all_gather/reduce_scatter bandwidth"),
        ("scaling", scaling, "throughput and efficiency for nproc 1..N, buckets and hooks"),
        ("tune", tune, "try DDP options, hooks, ZeRO and one process; recommend the fastest"),
    ):
        p = sub.add_parser(name, help=summary, description=(module.__doc__ or "").split("\n\n")[0])
        module.add_arguments(p)
        p.set_defaults(run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from ddpkit import SpawnError  # the public name: the tools use the public API only

    ns = build_parser().parse_args(argv)
    try:
        return ns.run(ns)
    except DdpkitError as err:
        print(f"ddpkit bench {ns.bench}: error: {err}", file=sys.stderr)
        return 2
    except SpawnError as err:
        if "did not finish within" not in str(err):  # a rank raised: its traceback is the report
            raise
        longer = "pass a longer --timeout (seconds), or " if hasattr(ns, "timeout") else ""
        print(
            f"ddpkit bench {ns.bench}: error: {str(err).strip()}. The ranks were stopped at the time limit; "
            f"{longer}measure less (fewer --rounds, a smaller workload or size)",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
