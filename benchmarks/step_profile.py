"""Where does a training step's time go? Counts that hold up under other jobs' load, per rank.

    torchrun --standalone --nproc-per-node 2 benchmarks/step_profile.py --variant ddp --workload cnn
    ddpkit run --nproc 2 benchmarks/step_profile.py --variant ddpkit --workload cnn

Variants are benchmarks/peers_worker.py's (`ddp`: hand-written DDP; `ddpkit`: the README's loop with
`s.backward`/`s.step`; `ddpkit-plain`: the README's plain loop, `loss.backward(); opt.step()`).
After --warmup steps, rank 0 reports per step: wall and process CPU time (all threads, gloo's included),
minor page faults, voluntary/involuntary context switches; then torch.profiler's op counts and self CPU
time over --profile-steps; then cProfile's call counts and the heaviest functions. Counts (ops, calls,
page faults) do not depend on the machine's load; CPU time depends on it much less than wall time.
Output: one JSON line `STEPPROFILE {...}` from rank 0 (`--out FILE` writes it there).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import os
import pstats
import resource
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import peers_worker as pw  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ddpkit.tools import workloads  # noqa: E402


def counters() -> tuple[float, float, int, int, int, float]:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), time.process_time(), ru.ru_minflt, ru.ru_nvcsw, ru.ru_nivcsw, launcher_cpu()


def launcher_cpu() -> float:
    """CPU seconds the parent process (the launcher's agent) has used so far: it shares the cores."""
    try:
        with open(f"/proc/{os.getppid()}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return 0.0


def timed(wl: Any, loop: Any, steps: int) -> dict[str, float]:
    a = counters()
    walls = []
    for _ in range(steps):
        t = time.perf_counter()
        pw.step(wl, loop)
        walls.append(time.perf_counter() - t)
    b = counters()
    walls.sort()
    return {
        "wall_ms_median": walls[len(walls) // 2] * 1e3,
        "wall_ms_mean": (b[0] - a[0]) / steps * 1e3,
        "cpu_ms": (b[1] - a[1]) / steps * 1e3,
        "minflt": (b[2] - a[2]) / steps,
        "vcsw": (b[3] - a[3]) / steps,
        "ivcsw": (b[4] - a[4]) / steps,
        "launcher_cpu_ms": (b[5] - a[5]) / steps * 1e3,
    }


def op_counts(wl: Any, loop: Any, steps: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            pw.step(wl, loop)
    ops: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.key_averages():
        ops[e.key][0] += e.count / steps
        ops[e.key][1] += e.self_cpu_time_total / steps / 1e3
    return {k: {"count": v[0], "self_ms": v[1]} for k, v in sorted(ops.items())}


def python_calls(wl: Any, loop: Any, steps: int) -> dict[str, Any]:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        pw.step(wl, loop)
    prof.disable()
    stats = pstats.Stats(prof)
    rows = []
    for (path, line, name), (_cc, nc, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append(
            {
                "fn": f"{os.path.basename(path)}:{line}:{name}",
                "calls": nc / steps,
                "tottime_ms": tt / steps * 1e3,
                "cumtime_ms": ct / steps * 1e3,
            }
        )
    total_calls = sum(r["calls"] for r in rows)
    rows.sort(key=lambda r: -r["tottime_ms"])
    return {"calls_per_step": total_calls, "top": rows[:40]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--variant", default="ddp", choices=(*pw.VARIANTS, "ddpkit-plain"))
    p.add_argument("--workload", default="cnn")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--profile-steps", type=int, default=30)
    p.add_argument(
        "--trace", type=int, default=0, help="only: wall, CPU, faults of each of the first N steps"
    )
    p.add_argument("--out", default=None)
    ns = p.parse_args()
    wl = workloads.load(ns.workload)
    data = wl.dataset(batches=8)
    loop = pw.make(ns.variant, wl, data)
    if ns.trace:
        trace = []
        for _ in range(ns.trace):
            a = counters()
            pw.step(wl, loop)
            b = counters()
            trace.append(
                [round((y - x) * (1e3 if i < 2 else 1), 3) for i, (x, y) in enumerate(zip(a, b, strict=True))]
            )
        if not dist.is_initialized() or dist.get_rank() == 0:
            print("STEPTRACE " + json.dumps({"variant": ns.variant, "trace": trace}), flush=True)
        loop.close()
        return
    for _ in range(ns.warmup):
        pw.step(wl, loop)
    report: dict[str, Any] = {
        "variant": ns.variant,
        "workload": ns.workload,
        "env": {
            k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "THP_MEM_ALLOC_ENABLE", "MALLOC_ARENA_MAX")
        },
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "model": type(loop.model).__name__,
        "ddp_options": {
            k: getattr(loop.model, k, None)
            for k in ("gradient_as_bucket_view", "static_graph", "bucket_bytes_cap")
        },
        "timed": timed(wl, loop, ns.steps),
        "ops": op_counts(wl, loop, ns.profile_steps),
        "python": python_calls(wl, loop, ns.profile_steps),
        "timed_after": timed(wl, loop, ns.steps),
    }
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        line = json.dumps(report)
        if ns.out:
            with open(ns.out, "w") as f:
                f.write(line)
        else:
            print("STEPPROFILE " + line, flush=True)
    loop.close()


if __name__ == "__main__":
    main()
