"""Data parallelism at the cost of threads: one process using the cores as threads vs one rank per core.

    .venv/bin/python benchmarks/threads_vs_ranks.py                         # mlp, gpt; 3 repetitions
    .venv/bin/python benchmarks/threads_vs_ranks.py --workloads mlp --reps 5 --json runs/tvr.json

The same README loop (benchmarks/peers_worker.py, variant ddpkit), the same global batch, on this
machine's cores C: "1 x C threads" is `python` with OMP_NUM_THREADS=C (no process group); "C x 1" is
`ddpkit run --nproc C` (one thread per rank: DDP, the shared-memory all-reduce and the sharded step
that ddpkit chooses on CPU); "1 x 1" is one process on one core (how well threads scale). Step =
median of steps 6..35 of rank 0; repetitions interleaved in rotated order; ratios taken within a
repetition, median [min, max]. The ratio the issue asks for is (C x 1) / (1 x C): 1.15 or less is
the goal. It is a benchmark (minutes), not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from ddpkit.bench import floor
from ddpkit.tools import workloads

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "peers_worker.py")
STEPS, WARMUP = 35, 5


def run(layout: str, workload: str, cores: int) -> float:
    """Median step (ms) of one launch in `layout`: "threads", "ranks", "ranks-allreduce" (ranks with the
    sharded step's gradient reduce-scatter off: DDP's all-reduce, the path before issue 34) or "single"."""
    bin_dir = os.path.dirname(sys.executable)
    with tempfile.TemporaryDirectory() as out:
        script = [WORKER, "--variant", "ddpkit", "--workload", workload, "--steps", str(STEPS), "--out", out]
        if layout.startswith("ranks"):
            cmd, threads = [os.path.join(bin_dir, "ddpkit"), "run", "--nproc", str(cores), *script], 1
        else:
            cmd, threads = [sys.executable, *script], cores if layout == "threads" else 1
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        if layout == "ranks":  # the reduce-scatter step is asked for (shard_optimizer="gradients")
            script += ["--shard-optimizer", "gradients"]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"{layout} on {workload} failed:\n{done.stderr[-3000:]}")
        with open(os.path.join(out, "rank0.json")) as f:
            rank0 = json.load(f)
    return statistics.median(rank0["step_s"][WARMUP:STEPS]) * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="mlp,gpt")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", default=None)
    ns = p.parse_args()
    cores = len(os.sched_getaffinity(0))
    layouts = ["threads", "ranks", "ranks-allreduce", "single"]
    print(f"threads_vs_ranks: {cores} cores; load average {os.getloadavg()[0]:.2f}", flush=True)
    copy_bps = floor.copy_bandwidth()
    print(f"one core copies {copy_bps / 1e9:.1f} GB/s (b.copy_(a), 64 MiB, median of 7)", flush=True)
    results: dict[str, dict[str, list[float]]] = {}
    for wl in ns.workloads.split(","):
        results[wl] = {lay: [] for lay in layouts}
        for rep in range(ns.reps):
            for lay in layouts[rep % len(layouts) :] + layouts[: rep % len(layouts)]:
                ms = run(lay, wl, cores)
                results[wl][lay].append(ms)
                print(f"  {wl} rep {rep + 1}/{ns.reps} {lay}: {ms:.1f} ms", flush=True)
    print(f"\nstep ms, median [min, max]; {cores} x 1: ddpkit run --nproc {cores}; 1 x {cores}: one process")
    for wl, by in results.items():
        cells = {k: f"{statistics.median(v):.1f} [{min(v):.1f}, {max(v):.1f}]" for k, v in by.items()}
        ratio = [r / t for r, t in zip(by["ranks"], by["threads"], strict=True)]
        before = [r / t for r, t in zip(by["ranks-allreduce"], by["threads"], strict=True)]
        scale = [s / t for s, t in zip(by["single"], by["threads"], strict=True)]
        grads = floor.grad_bytes_of(workloads.load(wl).build())
        floor_ratio = 1 + floor.exchange_floor_s(grads, cores, copy_bps) * 1e3 / statistics.median(
            by["threads"]
        )
        print(
            f"{wl}: 1 x {cores} {cells['threads']}; {cores} x 1 {cells['ranks']}; "
            f"{cores} x 1 all-reduce {cells['ranks-allreduce']}; 1 x 1 {cells['single']}; "
            f"ranks / threads {statistics.median(ratio):.2f} [{min(ratio):.2f}, {max(ratio):.2f}] "
            f"(all-reduce: {statistics.median(before):.2f} [{min(before):.2f}, {max(before):.2f}]); "
            f"floor {floor_ratio:.2f}, measured / floor {statistics.median(ratio) / floor_ratio:.2f}; "
            f"threads speed-up {statistics.median(scale):.2f} [{min(scale):.2f}, {max(scale):.2f}]"
        )
        print(
            "  "
            + floor.floor_line(
                statistics.median(by["ranks"]) / 1e3,
                statistics.median(by["threads"]) / 1e3,
                grads,
                cores,
                copy_bps,
            )
        )
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
