"""What the spike guard costs per step: `s.step` with and without `spike_guard`, interleaved.

    flock /tmp/ddpkit-cpu.lock .venv/bin/python benchmarks/spike_guard_cost.py --workload cnn

2 gloo ranks (1 thread each) train one of ddpkit's named workloads (ddpkit/tools/workloads.py) with
`s.accumulate` / `s.backward` / `s.step`; every round runs one step of each mode, so every mode sees the
same machine load: "clip" (max_norm=1.0, no guard), "clip+guard" (the same with the guard judging the
norm and an agreed loss), "plain" (no max_norm, no guard) and "plain+guard" (the guard computes the norm
itself). The guard is switched per step by swapping the stepper's judge (`Stepper.spikes`), a benchmark's
shortcut. Rank 0 prints each mode's median step time, quartiles and the ratio to its guard-less twin.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import ddpkit
from ddpkit.step import spikes
from ddpkit.tools import workloads

MODES = ("clip", "clip+guard", "plain", "plain+guard")


def _rank(name: str, reps: int) -> dict[str, list[float]]:
    w = workloads.load(name)
    with ddpkit.session(seed=0, verbose=False, log_to=None) as s:
        torch.manual_seed(0)
        net = s.model(w.build())
        opt = w.optimizer(net.parameters())
        batch = w.sample(torch.Generator().manual_seed(s.rank), w.global_batch // s.world_size)
        guard = spikes.SpikeGuard(threshold=1e9)  # never skips: every step is judged and applied
        judge = spikes.Judge(guard, world=s.world_size, report=s.print)
        times: dict[str, list[float]] = {m: [] for m in MODES}
        for rep in range(reps + 1):
            for mode in MODES:
                s.stepper.spikes = judge if mode.endswith("+guard") else None
                s.barrier()
                start = time.perf_counter()
                with s.accumulate(net):
                    loss = w.step_loss(net, batch)
                    s.backward(loss)
                if s.stepper.spikes is not None:
                    s.stepper.agree_loss(1.0)  # fit's agreed loss: a float it already has
                s.step(opt, max_norm=1.0 if mode.startswith("clip") else None)
                if rep:  # round 0 warms up
                    times[mode].append(time.perf_counter() - start)
        return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="cnn")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--reps", type=int, default=200, help="timed rounds (each: one step of every mode)")
    a = p.parse_args()
    r = ddpkit.spawn(_rank, a.nproc, (a.workload, a.reps), timeout=900, threads=1)[0]
    print(f"{a.workload}: {a.nproc} ranks, {a.reps} interleaved rounds")
    for mode in MODES:
        t = sorted(r[mode])
        q1, med, q3 = statistics.quantiles(t, n=4)
        base = statistics.median(r[mode.removesuffix("+guard")])
        print(f"  {mode:12s} median {med * 1e3:7.3f} ms  [q1 {q1 * 1e3:.3f}, q3 {q3 * 1e3:.3f}]  "
              f"x{med / base:.4f} of {mode.removesuffix('+guard')}")  # fmt: skip


if __name__ == "__main__":
    main()
