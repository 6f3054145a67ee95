"""`ddpkit plan --memory` against what the kernel measures on real CPU ranks: estimate, measured, error.

    python benchmarks/plan_memory.py      # every row: 3 models x ddp/fsdp x AC off/on x 2, 4 ranks
    python benchmarks/plan_memory.py --nproc 2 --models gpt --json runs/plan_memory.json
    python benchmarks/plan_memory.py --nproc 4 --strategies hsdp --shard-degree 2   # HSDP 2 x 2

Each row launches real ranks (`torch.distributed.run --standalone`, gloo, 1 thread each) that train
with `ddpkit.session` exactly the step the estimate runs on fake tensors: the same model factory,
micro-batch, loss (`ddpkit.plan.memory.resolve_model`), AdamW, `s.model(factory, strategy=...,
activation_checkpointing=...)`, two steps (the first creates the optimizer's state, the second is the
steady-state step the estimate tracks).

Allocator: by default (`--allocator exact`) the ranks run with glibc's mmap threshold fixed at 1 MiB
(`MALLOC_MMAP_THRESHOLD_`, which also stops glibc raising it) and ddpkit's CPU allocator policy off
(`DDPKIT_CPU_ALLOCATOR=default`): every block of 1 MiB or more is its own mapping, returned to the
kernel when freed, so the resident peak follows the live tensors and the table checks the tracked
peak itself. `--allocator ddpkit` keeps ddpkit's default policy (freed heap memory kept for reuse,
`ddpkit.step.cpu_allocator`): the peak then also holds the heap's fragmentation, which is what the
allocator allowance of `ddpkit.plan.devices` stands for.

Measured: per rank, the kernel's peak resident set (`VmHWM`) minus the rank's resident set just
before `s.model` (the process's baseline: torch, gloo, Python), after resetting the peak to the
baseline there (`echo 5 > /proc/self/clear_refs`), so imports and the process group's set-up do not
count; the table takes the largest rank's. Estimated: `ddpkit.plan.memory.estimate` for rank 0 (the
tracked peak, without the allocator allowance of `ddpkit.plan.devices`). Error: estimate / measured - 1.

What the two sides do not share: FSDP runs with `FSDPOptions(shm=False)` (FSDP2's collectives over
gloo, as the estimate's; ddpkit's default shared-memory path on CPU ranks maps a segment per session,
counted in every rank's resident set); DDP with `shard_optimizer=False` (plain DDP; the sharded step
is the estimate's "zero1"). The measured side also holds what no tensor tracker sees: gloo's
scratch buffers, DDP's reducer bookkeeping, the allocator's free blocks and page rounding.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODELS = {  # name: (model spec for ddpkit.plan.memory, micro-batch at 2 ranks, AC class, seq)
    "mlp": ("mlp", 64, "Linear", None),
    "gpt": ("gpt", 16, "Block", None),
    "gpt2": (
        "hf:gpt2,n_layer=4,n_embd=256,n_head=4,n_positions=256,vocab_size=8192,resid_pdrop=0,embd_pdrop=0,attn_pdrop=0",
        16,
        "auto",
        256,
    ),
}


def _status() -> dict[str, int]:
    text = Path("/proc/self/status").read_text()
    return {k: int(re.search(rf"{k}:\s+(\d+)", text).group(1)) * 1024 for k in ("VmRSS", "VmHWM")}  # type: ignore[union-attr]


def rank_main(case: dict, out: str) -> None:
    """One rank: baseline, s.model, two steps, the peak above the baseline."""
    import torch

    import ddpkit
    from ddpkit.plan import memory
    from ddpkit.strategy import FSDPOptions

    job = memory.MemoryJob(
        model=case["model"],
        micro_batch=case["micro_batch"],
        seq_len=case["seq"],
        strategy=case["strategy"],
        world=case["world"],
        device_kind="cpu",
        activation_checkpointing=case["ac"],
        shard_degree=case.get("shard"),
    )
    spec = memory.resolve_model(job)
    strategy: str | FSDPOptions = FSDPOptions(shm=False) if case["strategy"] == "fsdp" else "ddp"
    if case["strategy"] == "hsdp":  # forced on one machine: replicate world/shard x shard
        from ddpkit.strategy.hsdp_options import HSDPOptions

        strategy = HSDPOptions(replicate=case["world"] // case["shard"], shard=case["shard"], shm=False)
    with ddpkit.session(seed=0, strategy=strategy, shard_optimizer=False) as s:
        ac = None
        if case["ac"]:
            ac = "auto" if case["ac"] == "auto" else _class(spec, case["ac"])
        base = _status()["VmRSS"]
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS now
        with _allocator_log() as log:
            batch = spec.batch(case["micro_batch"])  # the estimate tracks the micro-batch too
            model = s.model(spec.build, activation_checkpointing=ac)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            tracked = None
            for i in range(2):
                tracker = _tracker(model, opt) if case.get("track") and i == 1 else contextlib.nullcontext()
                with tracker, torch.profiler.record_function(f"ddpkit_step_{i}"):
                    loss = spec.loss(model, batch)
                    loss.backward()
                    del loss
                    opt.step()
                    opt.zero_grad()
                if case.get("track") and i == 1:
                    tracked = _tracked(tracker)
        peak = _status()["VmHWM"]
        row = {"base": base, "peak": peak - base, "tracked": tracked, "allocator": _allocator_peak(log)}
        Path(out, f"rank{s.rank}.json").write_text(json.dumps(row))


@contextlib.contextmanager
def _allocator_log():  # type: ignore[no-untyped-def]
    """torch's CPU allocator's own statistics: with the profiler's memory recording on, c10's CPU
    allocator counts every block it hands out and takes back (`ProfiledCPUMemoryReporter`), and each
    allocation event carries the running total. Started after the baseline, so the total counts what
    the rank allocated since: the model, its gradients and optimizer state, the micro-batch and the
    step's activations and temporaries, including the scratch tensors kernels allocate inside
    themselves (which no dispatcher-level tracker sees). Not in it: what is allocated outside torch's
    allocator (gloo's buffers, oneDNN's own scratchpads, autograd's graph nodes, Python objects).
    Counted on every thread (`_every_thread_counted`), not only on the threads the profiler runs on.

    `torch.autograd.profiler.profile`, the profiler `torch.profiler.profile` runs for CPU activity, is
    started here directly: the wrapper's start (`prepare_trace`) asks `hasattr(torch, "_inductor")`,
    which imports the compiler (seconds of CPU in each rank) to read a CUDA-graph setting."""
    from torch.autograd.profiler import profile

    with _every_thread_counted(), profile(use_cpu=True, use_kineto=True, profile_memory=True) as prof:
        yield prof


@contextlib.contextmanager
def _every_thread_counted():  # type: ignore[no-untyped-def]
    """Keep the allocator's running total on every thread while the profiler records.

    The profiler's state is thread-local, and c10's allocator updates its total only where it is on
    (`memoryProfilingEnabled()` in `ProfiledCPUMemoryReporter::New` and `::Delete`): gloo runs each
    collective on a worker thread that carries the caller's state only while the collective runs, so
    when that thread drops the last reference to a collective's tensors after it (the caller has
    waited and moved on first; with 4 ranks on 2 cores it often has) the block is freed uncounted and
    stays in the total for the rest of the profile. Measured (docs/planning.md, the tiny GPT under FSDP
    with activation checkpointing at 4 ranks): 16.2 MiB of clones of the first step's reduce-scatter
    inputs (gloo all-reduces a `clone()` of the input) still in the total at the second step's peak,
    85.4 MiB read where the allocator held 69.2. c10's
    flag `caffe2_report_cpu_memory_usage` makes the allocator keep the total on every thread (its
    `LOG(INFO)` lines stay below c10's default log level); set here, restored after."""
    import ctypes

    import torch

    lib = Path(torch.__file__).parent / "lib" / "libc10.so"
    try:
        flag = ctypes.c_bool.in_dll(ctypes.CDLL(str(lib)), "FLAGS_caffe2_report_cpu_memory_usage")
    except (OSError, ValueError) as err:
        raise RuntimeError(
            f"cannot reach c10's flag caffe2_report_cpu_memory_usage in {lib} ({err}): the allocator's "
            "peak would miss the blocks freed on gloo's threads. Run the benchmark with a Linux torch wheel"
        ) from err
    old, flag.value = flag.value, True
    try:
        yield
    finally:
        flag.value = old


def _allocator_peak(prof: object, window: str = "ddpkit_step_1") -> int:
    """The largest running total of torch's CPU allocator during the second (steady-state) step, the
    step the estimate tracks: the CPU ranks' counterpart of `torch.cuda.max_memory_allocated`. Counted
    from the total at the profile's first allocation (the allocator's total is process-wide and never
    reset, so a process that profiled before would otherwise start above zero)."""
    from torch._C._profiler import _EventType

    roots = prof.kineto_results.experimental_event_tree()  # type: ignore[attr-defined]
    events, stack = [], list(roots)
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        events.append(e)
    every = sorted((e for e in events if e.tag == _EventType.Allocation), key=lambda e: e.start_time_ns)
    first = every[0].extra_fields
    start_total = first.total_allocated - first.alloc_size
    spans = [e for e in events if e.name == window]
    start, end = spans[0].start_time_ns, spans[0].end_time_ns
    inside = [e for e in every if start <= e.start_time_ns <= end]
    return max(e.extra_fields.total_allocated for e in inside) - start_total


def _tracker(model: object, opt: object) -> object:
    """torch's memory tracker on the rank's REAL tensors (`--track`): what the estimate's fake step
    should equal; the kernel's peak above it is memory no tensor holds."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, opt)
    return tracker


def _tracked(tracker: object) -> dict:
    from ddpkit.observe.memory_breakdown import Breakdown

    b = Breakdown.from_snapshot(tracker.get_tracker_snapshot("peak"))  # type: ignore[attr-defined]
    return {"peak": b.peak, **{k: v for k, v in b.as_dict().items() if isinstance(v, int)}}


def _class(spec: object, name: str) -> type:
    import torch

    with torch.device("meta"):
        model = spec.build()  # type: ignore[attr-defined]
    return next(type(m) for m in model.modules() if type(m).__name__ == name)


ALLOCATORS = {  # the ranks' malloc settings: see the module docstring
    "exact": {"DDPKIT_CPU_ALLOCATOR": "default", "MALLOC_MMAP_THRESHOLD_": str(1 << 20)},
    "ddpkit": {},
}


def measure(case: dict, allocator: str = "exact", timeout: float = 600) -> dict:
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **ALLOCATORS[allocator]}
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={case['world']}",
            __file__,
            "--rank-case",
            json.dumps(case),
            "--out",
            out,
        ]
        got = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if got.returncode:
            raise RuntimeError(f"ranks failed ({got.returncode}):\n{got.stderr[-3000:]}")
        ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
    tracked = [r["tracked"]["peak"] for r in ranks if r.get("tracked")]
    return {
        "measured": max(r["peak"] for r in ranks),
        "allocator": max(r["allocator"] for r in ranks),
        "base": max(r["base"] for r in ranks),
        "tracked_real": max(tracked) if tracked else None,
    }


def estimate(case: dict) -> dict:
    from ddpkit.plan import memory

    job = memory.MemoryJob(
        model=case["model"],
        micro_batch=case["micro_batch"],
        seq_len=case["seq"],
        strategy=case["strategy"],
        world=case["world"],
        device_kind="cpu",
        activation_checkpointing=case["ac"],
        shard_degree=case.get("shard"),
    )
    start = time.perf_counter()
    b = memory.estimate(job)
    return {"estimate": b.peak, "breakdown": b.as_dict(), "estimate_s": time.perf_counter() - start}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rank-case", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--strategies", nargs="+", default=["ddp", "fsdp"], choices=["ddp", "fsdp", "hsdp"])
    p.add_argument("--shard-degree", type=int, default=2, help="hsdp: ranks per shard group")
    p.add_argument("--ac", nargs="+", default=["off", "on"], choices=["off", "on"])
    p.add_argument("--allocator", choices=list(ALLOCATORS), default="exact")
    p.add_argument("--json", default=None)
    p.add_argument(
        "--track",
        action="store_true",
        help="also run torch's memory tracker on the ranks' real tensors in the measured step",
    )
    ns = p.parse_args()
    from ddpkit.plan.devices import CPU_ALLOWANCE, CPU_RESERVED

    if ns.rank_case:
        rank_main(json.loads(ns.rank_case), ns.out)
        return
    load = os.getloadavg()[0]
    rows = []
    print(
        "| model | strategy | AC | ranks | micro-batch | estimate MiB | allocator peak MiB | error | "
        "VmHWM above baseline MiB | error | outside the allocator MiB | baseline MiB | "
        "plan total MiB | whole VmHWM MiB | error |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in ns.models:
        spec, mb2, ac_class, seq = MODELS[name]
        for n in ns.nproc:
            for strategy in ns.strategies:
                for ac in ns.ac:
                    case = {
                        "model": spec,
                        "micro_batch": mb2 * 2 // n,
                        "seq": seq,
                        "strategy": strategy,
                        "world": n,
                        "ac": ac_class if ac == "on" else None,
                        "track": ns.track,
                    }
                    if strategy == "hsdp":
                        case["shard"] = ns.shard_degree
                    row = {"name": name, **case, **estimate(case), **measure(case, ns.allocator)}
                    row["error"] = row["estimate"] / row["measured"] - 1
                    row["allocator_error"] = row["estimate"] / row["allocator"] - 1
                    # the whole rank: the plan's total for a CPU rank (tracked peak + the allocator
                    # allowance + the runtime reserve, ddpkit.plan.devices) against its whole VmHWM
                    row["total"] = row["estimate"] + round(row["estimate"] * CPU_ALLOWANCE) + CPU_RESERVED
                    row["whole"] = row["measured"] + row["base"]
                    row["total_error"] = row["total"] / row["whole"] - 1
                    rows.append(row)
                    if ns.json:  # after every row: a run cut short keeps what it measured
                        Path(ns.json).parent.mkdir(parents=True, exist_ok=True)
                        Path(ns.json).write_text(json.dumps({"rows": rows, "load": load}, indent=2))
                    real = row["tracked_real"]
                    mib = {k: row[k] / 2**20 for k in ("estimate", "allocator", "measured", "base")}
                    shard = ns.shard_degree
                    shown = f"hsdp {n // shard}x{shard}" if strategy == "hsdp" else strategy
                    print(
                        f"| {name} | {shown} | {ac} | {n} | {case['micro_batch']} | "
                        f"{mib['estimate']:.1f} | {mib['allocator']:.1f} | {row['allocator_error']:+.1%} | "
                        f"{mib['measured']:.1f} | {row['error']:+.1%} | "
                        f"{mib['measured'] - mib['allocator']:.1f} | {mib['base']:.1f} | "
                        f"{row['total'] / 2**20:.1f} | {row['whole'] / 2**20:.1f} | "
                        f"{row['total_error']:+.1%} |" + (f" {real / 2**20:.1f} |" if real else ""),
                        flush=True,
                    )
    worst = max(abs(r["allocator_error"]) for r in rows)
    worst_hwm = max(abs(r["error"]) for r in rows)
    print(
        f"\nworst error against the allocator's peak {worst:.1%}, against VmHWM {worst_hwm:.1%}; "
        f"load average {load:.2f} at the start, {os.getloadavg()[0]:.2f} at the end"
    )


if __name__ == "__main__":
    main()
