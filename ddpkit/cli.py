"""The `ddpkit` command: a thin shell over the Python API.

ddpkit run [--nproc auto|N] [--nnodes N|MIN:MAX --node-rank R --rdzv-endpoint HOST:PORT]
           [--max-restarts K] [--port P] [--device auto|cpu|cuda] [--share-gpu] script.py args...
ddpkit run -m package.module args...
ddpkit demo [--nproc N] [--epochs E]
ddpkit checkpoint inspect DIR | convert DIR OUT   (offline: no process group)
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

from ddpkit.errors import DdpkitError
from ddpkit.names import DEFAULT_PREEMPTION_SIGNAL, ELASTIC_BATCH_CHOICES, REQUEUE_CHOICES

# Tools parse their own arguments; their modules are imported only when asked for (fast start-up).
# Each module has `main(argv: list[str]) -> int`.
TOOLS: dict[str, tuple[str, str]] = {
    "verify": ("ddpkit.verify.cli", "check that DDP trains the same weights as one process"),
    "doctor": ("ddpkit.tools.doctor", "what this machine offers, and a 2-rank smoke test"),
    "bench": ("ddpkit.bench.cli", "collectives, scaling and tuning benchmarks"),
    "trace": ("ddpkit.tools.trace", "per-rank timeline of forward, backward, buckets and all-reduce"),
    "plan": ("ddpkit.plan.cli", "predict step time and efficiency at N devices from one device's profile"),
    "lint": ("ddpkit.lint.cli", "find DDP traps in training scripts, without running them"),
    "checkpoint": ("ddpkit.checkpoint.cli", "look into a checkpoint; convert it to other formats and back"),
}


def _nproc(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a whole number, got {value!r}") from None


def _nnodes(value: str) -> tuple[int | None, int]:
    """ "4" -> (None, 4); "1:4" -> (1, 4): an elastic job of 1 to 4 nodes."""
    low, sep, high = value.partition(":")
    try:
        return (int(low), int(high)) if sep else (None, int(value))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX, got {value!r}") from None


def _add_launch_options(p: argparse.ArgumentParser, *, default_nproc: str | None) -> None:
    p.add_argument("--nproc", type=_nproc, default=default_nproc, help="processes per node: auto or N")
    p.add_argument("--nnodes", type=_nnodes, default=(None, 1), help="nodes: N, or MIN:MAX (elastic)")
    p.add_argument("--node-rank", type=int, default=None, help="this node's rank, 0..nnodes-1")
    p.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT where the nodes meet")
    p.add_argument("--port", type=int, default=None, help="single node: rendezvous port (default: free)")
    p.add_argument("--max-restarts", type=int, default=0, help="restart all workers up to K times")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--share-gpu", action="store_true", help="ranks share GPUs (gloo; debugging)")


def _version() -> str:
    """The installed distribution's version (a wheel's or an editable install's metadata), read without
    importing torch, so `ddpkit --version` answers at once."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ddpkit")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ddpkit", description="Data-parallel PyTorch, correct and fast.")
    parser.add_argument("--version", action="version", version=f"ddpkit {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="launch a script on N processes (torchrun-compatible)")
    _add_launch_options(run, default_nproc="auto")
    run.add_argument("-m", dest="module", action="store_true", help="run the target as a module")
    run.add_argument(
        "--preemption-signal", default=DEFAULT_PREEMPTION_SIGNAL, help="besides SIGTERM: save and stop (USR1)"
    )
    run.add_argument("--requeue", choices=REQUEUE_CHOICES, default="auto", help="Slurm: requeue after it")
    run.add_argument("--grace", type=float, default=30.0, help="seconds to let ranks save when stopped")
    run.add_argument(
        "--elastic-batch",
        choices=ELASTIC_BATCH_CHOICES,
        default="auto",
        help="--nnodes MIN:MAX at fewer nodes: keep the per-rank batch (accumulate more) or not",
    )
    run.add_argument("--rdzv-conf", default=None, help="elastic: torchrun's rendezvous settings (k=v,...)")
    run.add_argument("--local-addr", default=None, help="this node's address as the other nodes reach it")
    run.add_argument("target", help="script.py, or a module name with -m")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")

    for name, (_, summary) in TOOLS.items():
        tool = sub.add_parser(name, help=summary, add_help=False)
        tool.add_argument("tool_args", nargs=argparse.REMAINDER)

    demo = sub.add_parser("demo", help="train a CNN on scikit-learn's digits with DDP")
    _add_launch_options(demo, default_nproc=None)
    demo.add_argument("--epochs", type=int, default=12)
    demo.add_argument("--out", default="ddpkit-demo", help="folder for the loss-curve PNG")
    return parser


class Command(NamedTuple):
    """One command of the tree `commands` walks: "ddpkit run", "ddpkit bench tune", "ddpkit plan --memory"."""

    where: str
    summary: str  # its line in the parent's --help ("" for a tool's mode)
    depth: int  # 0: a subcommand of `ddpkit`; one more per subcommand or mode below
    parser: argparse.ArgumentParser


def commands(build: Callable[[], argparse.ArgumentParser] | None = None) -> Iterator[Command]:
    """Every command's parser, in the order `ddpkit --help` lists them, each followed by its subcommands
    and its modes: a tool's own parser in place of its placeholder here (taken at its `parse_args`, before
    anything of the tool runs), and each flag of the tool that hands the arguments to a parser of another
    shape (`ddpkit plan --memory`). The one walk the command-line reference (scripts/docs_cli.py) and the
    option inventory (tests/test_option_inventory.py) read."""
    top = (build or build_parser)()
    summaries = _summaries(top)
    for name, sub in _subcommands(top).items():
        where = f"ddpkit {name}"
        if name not in TOOLS:
            yield from _tree(where, summaries.get(name, ""), 0, sub)
            continue
        main = importlib.import_module(TOOLS[name][0]).main
        parser = captured_parser(main, [])
        parser.prog = where
        yield from _tree(where, summaries.get(name, ""), 0, parser)
        for action in parser._actions:
            if isinstance(action, argparse._StoreTrueAction) and action.option_strings:
                flag = next(
                    (s for s in action.option_strings if s.startswith("--")), action.option_strings[0]
                )
                mode = captured_parser(main, [flag])
                if _shape(mode) != _shape(parser):
                    mode.prog = f"{where} {flag}"
                    yield from _tree(f"{where} {flag}", "", 1, mode)


def _tree(where: str, summary: str, depth: int, parser: argparse.ArgumentParser) -> Iterator[Command]:
    yield Command(where, summary, depth, parser)
    summaries = _summaries(parser)
    for name, sub in _subcommands(parser).items():
        yield from _tree(f"{where} {name}", summaries.get(name, ""), depth + 1, sub)


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {name: p for a in subs for name, p in a.choices.items()}


def _summaries(parser: argparse.ArgumentParser) -> dict[str, str]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {c.dest: c.help or "" for a in subs for c in a._choices_actions}


def _shape(parser: argparse.ArgumentParser) -> tuple:
    return tuple(sorted((a.dest, *a.option_strings) for a in parser._actions))


class _Parsed(BaseException):  # not an Exception: a tool's `except Exception` must not swallow it
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def captured_parser(main: Callable[[list[str]], Any], argv: list[str]) -> argparse.ArgumentParser:
    """The parser `main(argv)` parses its arguments with, stopped at `parse_args`: the tools build theirs
    inside `main`, and nothing of the tool runs before its arguments are parsed."""
    from unittest import mock

    def stop(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        raise _Parsed(self)

    with (
        mock.patch.object(argparse.ArgumentParser, "parse_args", stop),
        mock.patch.object(argparse.ArgumentParser, "parse_known_args", stop),
    ):
        try:
            main(argv)
        except _Parsed as parsed:
            return parsed.parser
    raise RuntimeError(f"{main.__module__}.main({argv}) returned without parsing its arguments")


def _launch_config(ns: argparse.Namespace, target: str, args: Sequence[str], module: bool):
    from ddpkit.cluster.launch import LaunchConfig

    return LaunchConfig(
        target=target,
        args=tuple(args),
        module=module,
        nproc=ns.nproc,
        device=ns.device,
        share_gpu=ns.share_gpu,
        min_nodes=ns.nnodes[0],
        nnodes=ns.nnodes[1],
        node_rank=ns.node_rank,
        rdzv_endpoint=ns.rdzv_endpoint,
        port=ns.port,
        max_restarts=ns.max_restarts,
        **(
            {
                "preemption_signal": ns.preemption_signal,
                "requeue": ns.requeue,
                "grace": ns.grace,
                "elastic_batch": ns.elastic_batch,
                "rdzv_conf": ns.rdzv_conf,
                "local_addr": ns.local_addr,
            }
            if ns.command == "run"
            else {}
        ),
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in TOOLS:  # before argparse, which would claim the tool's own options
        try:
            return importlib.import_module(TOOLS[argv[0]][0]).main(argv[1:])
        except DdpkitError as err:
            print(f"ddpkit {argv[0]}: error: {err}", file=sys.stderr)
            return 2
    ns = build_parser().parse_args(argv)
    try:
        if ns.command == "run":
            from ddpkit.cluster.launch import launch

            return launch(_launch_config(ns, ns.target, ns.args, ns.module))
        if ns.command == "demo":
            from ddpkit.tools.demo import launch_demo

            return launch_demo(ns, _launch_config)
    except DdpkitError as err:
        print(f"ddpkit {ns.command}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
