"""What reproducible="any-world" costs: step time and memory against normal DDP, per chunk size.

    flock /tmp/ddpkit-cpu.lock python benchmarks/invariant_cost.py --workload gpt            # time
    flock /tmp/ddpkit-cpu.lock python benchmarks/invariant_cost.py --workload gpt --memory   # memory

Time: 2 gloo ranks (1 thread each) train one of ddpkit's named workloads (ddpkit/tools/workloads.py:
cnn, mlp, gpt, their global batch and optimizer), one model, alternating in every round a normal DDP
step and one `ddpkit.step.invariant` step per chunk size, so every mode sees the same machine load;
rank 0 prints each mode's median step time, the spread (quartiles) and the ratio to DDP's median.
Memory: each mode in fresh ranks (`--memory`), 3 steps after one warm-up; the largest peak resident set
(ru_maxrss) of the ranks, and its excess over normal DDP's (the chunk's smaller activations against the
tree's flat buffers and the all-gather's W copies).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch

import ddpkit
from ddpkit.step import invariant
from ddpkit.tools import workloads

CHUNKS = {"cnn": (2, 4, 8, 16, 32), "mlp": (2, 4, 8, 16, 32), "gpt": (1, 2, 4, 8)}


def _rank(name: str, modes: list[str], reps: int) -> dict[str, list[float] | int]:
    w = workloads.load(name)
    with ddpkit.session(seed=0, verbose=False) as s:
        torch.manual_seed(0)
        net = s.model(w.build())
        opt = w.optimizer(net.parameters())
        per_rank = w.global_batch // s.world_size
        batch = w.sample(torch.Generator().manual_seed(s.rank), per_rank)
        states = {m: invariant.AnyWorld(int(m[4:]), seed=0) for m in modes if m.startswith("inv-")}

        def step(mode: str) -> None:
            if mode == "ddp":
                w.step_loss(net, batch).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            else:
                states[mode].step(net, opt, batch, w.step_loss)

        times: dict[str, list[float] | int] = {m: [] for m in modes}
        for rep in range(reps + 1):
            for mode in modes:
                s.barrier()
                start = time.perf_counter()
                step(mode)
                if rep:  # round 0 warms up
                    times[mode].append(time.perf_counter() - start)  # type: ignore[union-attr]
        times["maxrss_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=sorted(CHUNKS), default="gpt")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--reps", type=int, default=8, help="timed rounds (each: one step of every mode)")
    p.add_argument("--memory", action="store_true", help="peak memory per mode, each in fresh ranks")
    a = p.parse_args()
    modes = ["ddp"] + [f"inv-{m}" for m in CHUNKS[a.workload]]
    batch = workloads.load(a.workload).global_batch
    if a.memory:
        peaks = {}
        for mode in modes:
            ranks = ddpkit.spawn(_rank, a.nproc, (a.workload, [mode], 3), timeout=900, threads=1)
            peaks[mode] = max(int(r["maxrss_kb"]) for r in ranks) / 1024
        for mode in modes:
            extra = peaks[mode] - peaks["ddp"]
            print(f"{a.workload} {mode:7s} peak RSS {peaks[mode]:7.0f} MiB  vs ddp {extra:+6.0f} MiB")
        return
    r = ddpkit.spawn(_rank, a.nproc, (a.workload, modes, a.reps), timeout=900, threads=1)[0]
    base = statistics.median(r["ddp"])  # type: ignore[arg-type]
    print(f"{a.workload}: global batch {batch}, {a.nproc} ranks, {a.reps} interleaved rounds")
    for mode in modes:
        t = sorted(r[mode])  # type: ignore[arg-type]
        q1, med, q3 = statistics.quantiles(t, n=4)[0], statistics.median(t), statistics.quantiles(t, n=4)[2]
        chunks = "" if mode == "ddp" else f" ({batch // int(mode[4:]) // a.nproc} chunks/rank)"
        print(
            f"  {mode:7s}{chunks:17s} median {med * 1e3:8.1f} ms  [q1 {q1 * 1e3:.1f}, q3 {q3 * 1e3:.1f}]  "
            f"x{med / base:.2f} of ddp"
        )


if __name__ == "__main__":
    main()
