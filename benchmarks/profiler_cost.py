"""What the profiler switch costs when it is off: a step with no switch at all against a step with it off.

    flock /tmp/ddpkit-cpu.lock .venv/bin/python benchmarks/profiler_cost.py --workload cnn

One process (1 thread) trains one of ddpkit's named workloads (ddpkit/tools/workloads.py) with
`s.accumulate` / `s.backward` / `s.step`. Three modes, one step each per round, in an order shuffled
from round to round: "none" (no switch: the step alone), "off" (what a session with `profile=None`
does at each step's end: `StepProfiler.build(None, ...)` gave None, so `if profiler is not None:
profiler.step()` is one comparison) and "not chosen" (a rank outside `ranks=` holds a `NullProfiler`,
whose `step()` returns at once). Printed: the median of the repeats' median step times with their
range, each mode's ratio to "none", and the switch's own cost timed alone over a million calls (the
step-time ranges cannot resolve nanoseconds). `uptime`'s load is printed before and after.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch

import ddpkit
from ddpkit.observe.profiling import StepProfiler
from ddpkit.tools import workloads

MODES = ("none", "off", "not chosen")


def _per_call(profiler: object, calls: int = 1_000_000) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        if profiler is not None:
            profiler.step()  # type: ignore[attr-defined]
    return (time.perf_counter() - start) / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="cnn")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--rounds", type=int, default=50)
    a = p.parse_args()
    print(f"load before: {os.getloadavg()[0]:.2f}")
    torch.set_num_threads(1)
    w = workloads.load(a.workload)
    with ddpkit.session(seed=0, verbose=False, log_to=None, env={}) as s:
        net = s.model(w.build())
        opt = w.optimizer(net.parameters())
        batch = w.sample(torch.Generator().manual_seed(0), w.global_batch)
        switches = {
            "none": None,
            "off": StepProfiler.build(None, 0),
            "not chosen": StepProfiler.build({"ranks": (1,)}, 0),
        }

        def step(mode: str) -> None:
            with s.accumulate(net):
                s.backward(w.step_loss(net, batch))
            s.step(opt)
            if mode != "none":
                profiler = switches[mode]
                if profiler is not None:
                    profiler.step()

        for _ in range(10):
            step("none")
        order = random.Random(0)
        medians: dict[str, list[float]] = {m: [] for m in MODES}
        for _ in range(a.repeats):
            times: dict[str, list[float]] = {m: [] for m in MODES}
            for _ in range(a.rounds):
                for mode in order.sample(MODES, len(MODES)):
                    start = time.perf_counter()
                    step(mode)
                    times[mode].append(time.perf_counter() - start)
            for mode in MODES:
                medians[mode].append(statistics.median(times[mode]))
    print(f"load after: {os.getloadavg()[0]:.2f}")
    print(f"{a.workload}: 1 process, {a.repeats} repeats x {a.rounds} interleaved rounds")
    print("| mode | median step ms [range] | x none, median [range] | the switch alone, ns per step |")
    print("|---|---|---|---|")
    for mode in MODES:
        med = medians[mode]
        ratios = [m / b for m, b in zip(med, medians["none"], strict=True)]
        alone = "" if mode == "none" else f"{_per_call(switches[mode]) * 1e9:.0f}"
        print(
            f"| {mode} | {statistics.median(med) * 1e3:.3f} [{min(med) * 1e3:.3f}, {max(med) * 1e3:.3f}] | "
            f"x{statistics.median(ratios):.4f} [{min(ratios):.4f}, {max(ratios):.4f}] | {alone} |"
        )


if __name__ == "__main__":
    main()
