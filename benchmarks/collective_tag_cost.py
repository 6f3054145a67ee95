"""What the tag of a script's collective costs: `s.any_rank` (tagged, `Membership.agree`) against the same
all-reduce untagged (`RankContext.any_rank`), interleaved round by round.

    ddpkit run --nproc 2 benchmarks/collective_tag_cost.py [--calls 200] [--rounds 5]

Every script's `s.all_reduce`, `s.any_rank`, `s.all_ranks`, `s.gather`, `s.gather_object` and `s.barrier`
is tagged in the c10d store first (one set, polls of the peers' keys, one delete), so a rank that reaches
it alone is refused by name instead of meeting another collective. Rank 0 prints, per mode, the median
microseconds per call over the rounds and their range; the difference is the tag's cost, paid once per
call (ddpkit's own per-step calls carry none).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import ddpkit
from ddpkit.cluster.ranks import RankContext


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    with ddpkit.session(verbose=False) as s:  # quiet: only the rows below
        modes = {"tagged": s.any_rank, "untagged": lambda flag: RankContext.any_rank(s, flag)}
        times: dict[str, list[float]] = {name: [] for name in modes}
        for _ in range(a.rounds):
            for name, call in modes.items():
                start = time.perf_counter()
                for _ in range(a.calls):
                    call(False)
                times[name].append((time.perf_counter() - start) / a.calls * 1e6)
        load = os.getloadavg()[0]
        for name, values in times.items() if s.is_main else ():
            print(
                f"{name}: median {statistics.median(values):.0f} us/call, range {min(values):.0f}-"
                f"{max(values):.0f} ({a.rounds} rounds x {a.calls} calls, {s.world_size} ranks, "
                f"load {load:.1f})"
            )


if __name__ == "__main__":
    main()
