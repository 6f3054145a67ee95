"""Memory per rank under DDP, the sharded optimizer step, FSDP2 and HSDP for one workload, with step time.

    python benchmarks/memory.py                          # mlp (37.8M parameters, AdamW), 2 and 4 CPU ranks
    python benchmarks/memory.py --nproc 2 --steps 8 --json runs/memory.json
    python benchmarks/memory.py --nproc 2 --modes ddp fsdp fsdp-gloo --rounds 3   # interleaved rounds
    python benchmarks/memory.py --nproc 4 --modes ddp fsdp fsdp-gloo hsdp         # HSDP(2x2) on 4 ranks

Per rank, counted from the tensors themselves (FSDP's DTensors by their local shard): parameter bytes,
gradient bytes (after the backward of a step, before the optimizer zeroes them), optimizer-state bytes
(after the step), their sum as "model state"; and each rank's PEAK memory from process start: its peak
RSS (`ru_maxrss`: torch itself, buffers, activations, a block's all-gather, the allocator's cache) on
CPU ranks, `torch.cuda.max_memory_allocated` on GPU ranks. Ranks start fresh ("spawn"), so the peak
is the rank's own. FSDP builds the model from the workload's factory (`s.model(workload.build)`), so
no rank holds it whole; DDP and the sharded step build it whole, as a user would. Step time: the median
of `--steps` timed steps after one warm-up step, wall clock on rank 0 between barriers. Each mode runs
in its own processes.

Modes: "fsdp" is FSDP2 as ddpkit sets it up (on CPU ranks of one machine its all-gather and
reduce-scatter go through shared memory, `ddpkit.parallel.fsdp_shm`); "fsdp-gloo" the same with
`FSDPOptions(shm=False)` (FSDP2's own collectives over gloo); "fsdp-slots" the shared-memory path with
the all-gather output private (`fsdp_shm.SHARED_GATHER = False`: the shard copied into a slot and the
others' slots into the output, as before issue 34's copy cut); "fsdp-keep" the shared-memory path on
a rank that keeps freed memory (`cpu_allocator.apply()` after `s.model`, as a DDP rank of a big model:
FSDP2's per-block parameters and gradients are then not page-faulted in again at every step; the
memory the FSDP ranks otherwise give back stays resident); "fsdp-heap" the same ranks serving every
block from malloc's heap (`M_MMAP_MAX=0`) but trimming its free top past 1 MiB; "hsdp" is HSDP
(`HSDPOptions(replicate=2, shard=W/2)`: 2 replicas of W/2 shards, the forced shape of one machine; its
collectives over gloo, so "fsdp-gloo" is the FSDP to compare its time with). Faults / step: rank
0's minor page faults per timed step (`ru_minflt`), with its system time; shared RSS: rank 0's resident
shared memory at the end (`RssShmem`: the segments, counted in full in every rank's RSS and peak).
`--rounds N` runs the modes N times, interleaved (mode a, b, c, a, b, c, ...), and reports the median
step and peak over the rounds with the step's [min, max].

The floor (`ddpkit.bench.floor`): before the ranks start, one process at 1 thread times a rank's
arithmetic alone (forward and backward on global_batch / W samples: `fwd+bwd`; the optimizer step on
the whole model: `opt`; big blocks kept from step to step as on a DDP rank, `cpu_allocator.fit_to`,
so no page faults), and one core's copy bandwidth. DDP's floor: fwd+bwd + opt + its least
all-reduce (`exchange_floor_s`); FSDP's: fwd+bwd + opt / W + its least exchange (`fsdp_floor_s`);
both stretched by W / cores when ranks outnumber the cores. The table gives each step / its floor.

Goals (issue 21): FSDP's peak per rank <= 0.6x DDP's at 2 ranks, <= 0.45x at 4.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import statistics
import time

import torch
from torch import nn

import ddpkit
from ddpkit.bench import floor
from ddpkit.parallel import cpu_allocator, fsdp_shm
from ddpkit.strategy import FSDPOptions
from ddpkit.strategy.hsdp_options import HSDPOptions
from ddpkit.tools import workloads

MODES = ("ddp", "sharded-step", "fsdp", "fsdp-gloo", "fsdp-slots", "fsdp-keep", "fsdp-heap", "hsdp")


def _bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def _rss_shmem() -> int:
    """Bytes of shared memory this process has resident now (`RssShmem`, Linux): counted in full in
    every rank's RSS (and so in its peak) though the ranks share them."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssShmem:"))
    except (OSError, StopIteration, ValueError):
        return 0


def _peak(device: torch.device) -> int:
    """This rank's peak memory since it started: RSS on a CPU rank, allocated bytes on a GPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _rank(workload_name: str, mode: str, steps: int, keep: int) -> dict:
    workload = workloads.load(workload_name)
    fsdp_shm.KEEP_PER_SIZE = keep
    fsdp_shm.SHARED_GATHER = mode != "fsdp-slots"  # this rank's own process (spawned fresh)
    shard = mode == "sharded-step"
    fsdp = mode.startswith("fsdp") or mode == "hsdp"
    strategy: object = FSDPOptions(shm=mode != "fsdp-gloo") if fsdp else "ddp"
    if mode == "hsdp":  # 2 replicas x W/2 shards on this machine's W ranks
        strategy = HSDPOptions(replicate=2)
    with ddpkit.session(seed=0, verbose=False, shard_optimizer=shard, strategy=strategy) as s:
        model: nn.Module = s.model(workload.build if fsdp else workload.build())
        if mode == "fsdp-keep":
            cpu_allocator.apply()
        if mode == "fsdp-heap":  # every block from malloc's heap, its free top trimmed past 1 MiB
            libc = ctypes.CDLL(None)
            libc.mallopt(-4, 0)  # M_MMAP_MAX
            libc.mallopt(-1, 2**20)  # M_TRIM_THRESHOLD
        opt = workload.optimizer(model.parameters())
        loader = s.loader(workload.dataset(batches=steps + 1), batch_size=workload.global_batch)
        grads, times, usage = 0, [], resource.getrusage(resource.RUSAGE_SELF)
        for i, batch in enumerate(loader):
            s.barrier()
            if i == 1:
                usage = resource.getrusage(resource.RUSAGE_SELF)
            start = time.perf_counter()
            with s.accumulate(model):
                s.backward(workload.step_loss(model, batch))
            grads = sum(_bytes(p.grad) for p in model.parameters())
            s.step(opt)
            s.barrier()
            if i > 0:
                times.append(time.perf_counter() - start)
        end = resource.getrusage(resource.RUSAGE_SELF)
        timed = max(1, len(times))
        params = sum(_bytes(p) for p in model.parameters())
        tensors = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        state = sum(_bytes(v) for v in tensors)
        return {
            "params": params,
            "grads": grads,
            "optimizer": state,
            "model_state": params + grads + state,
            "peak": _peak(s.device),
            "shmem": _rss_shmem(),
            "faults": (end.ru_minflt - usage.ru_minflt) / timed,
            "sys_s": (end.ru_stime - usage.ru_stime) / timed,
            "step_s": statistics.median(times) if times else float("nan"),
        }


def _compute(workload_name: str, world: int, reps: int = 5) -> tuple[float, float, float]:
    """(fwd+bwd, opt) seconds, medians of `reps` after one warm-up, one process at 1 thread: a rank's
    forward and backward on its global_batch / `world` samples, and the optimizer on the whole model;
    and one core's copy bandwidth. Run in a process of its own: a process spawned later inherits its
    parent's peak RSS (Linux keeps `ru_maxrss` across exec), so the parent must stay small."""
    workload = workloads.load(workload_name)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = workload.build()
        cpu_allocator.fit_to(model)  # as a DDP rank: a big model's blocks kept, no page faults per step
        opt = workload.optimizer(model.parameters())
        x, y = workload.dataset(batches=1)[: max(1, workload.global_batch // world)]
        passes, steps = [], []
        for _ in range(reps + 1):
            opt.zero_grad(set_to_none=True)
            start = time.perf_counter()
            workload.step_loss(model, (x, y)).backward()
            mid = time.perf_counter()
            opt.step()
            passes.append(mid - start)
            steps.append(time.perf_counter() - mid)
        return statistics.median(passes[1:]), statistics.median(steps[1:]), floor.copy_bandwidth()
    finally:
        torch.set_num_threads(threads)


def floor_s(
    mode: str, fwd_bwd: float, opt: float, param_bytes: float, world: int, copy_bps: float, cores: int
) -> float | None:
    """The step's floor for `mode` (module doc), or None where none is computed (the sharded step)."""
    if mode == "ddp":
        exchange = floor.exchange_floor_s(param_bytes, world, copy_bps)
        return (fwd_bwd + opt + exchange) * max(1.0, world / cores)
    if mode.startswith("fsdp"):
        return floor.fsdp_floor_s(fwd_bwd + opt / world, param_bytes, world, copy_bps, cores)
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="mlp")
    p.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--rounds", type=int, default=1, help="run the modes this many times, interleaved")
    p.add_argument(
        "--keep-per-size",
        type=int,
        default=fsdp_shm.KEEP_PER_SIZE,
        help="fsdp_shm.KEEP_PER_SIZE on the FSDP ranks: buffers kept per size",
    )
    p.add_argument("--json", default=None)
    ns = p.parse_args()
    if "ddp" not in ns.modes:
        ns.modes.insert(0, "ddp")  # the reference of every ratio
    if "hsdp" in ns.modes and not any(n % 2 == 0 and n >= 4 for n in ns.nproc):
        p.error("--modes hsdp runs 2 replicas of nproc / 2 shards: pass an even --nproc of 4 or more")
    cores = len(os.sched_getaffinity(0))
    param_bytes = floor.grad_bytes_of(workloads.load(ns.workload).build())
    print(f"load average {os.getloadavg()[0]:.2f}; {cores} cores", flush=True)
    rows, lines = [], []
    for nproc in ns.nproc:
        fwd_bwd, opt, copy_bps = ddpkit.spawn(_compute, 1, (ns.workload, nproc), threads=1, timeout=600)[0]
        print(f"one core copies {copy_bps / 1e9:.1f} GB/s (b.copy_(a), 64 MiB, median of 7)", flush=True)
        print(
            f"{nproc} ranks: a rank's compute alone, 1 thread: fwd+bwd {fwd_bwd * 1e3:.0f} ms "
            f"(batch {max(1, workloads.load(ns.workload).global_batch // nproc)}), opt {opt * 1e3:.0f} ms "
            "(whole model)",
            flush=True,
        )
        hsdp = nproc % 2 == 0 and nproc >= 4  # 2 replicas of at least 2 shards
        runs: dict[str, list[dict]] = {mode: [] for mode in ns.modes if mode != "hsdp" or hsdp}
        for _ in range(ns.rounds):
            for mode in runs:
                args = (ns.workload, mode, ns.steps, ns.keep_per_size)
                ranks = ddpkit.spawn(_rank, nproc, args, threads=1, timeout=600)
                worst = {k: max(r[k] for r in ranks) for k in ranks[0]}  # the most loaded rank
                peaks = [r["peak"] for r in ranks]
                runs[mode].append(
                    {
                        **worst,
                        "step_s": ranks[0]["step_s"],
                        "peaks": peaks,
                        "faults": ranks[0]["faults"],
                        "sys_s": ranks[0]["sys_s"],
                        "shmem": ranks[0]["shmem"],
                    }
                )
        for mode, done in runs.items():
            steps = [d["step_s"] for d in done]
            mid = sorted(done, key=lambda d: d["step_s"])[len(done) // 2]
            rows.append(
                {
                    "nproc": nproc,
                    "mode": mode,
                    **mid,
                    "step_s": statistics.median(steps),
                    "step_min": min(steps),
                    "step_max": max(steps),
                    "peak": statistics.median(d["peak"] for d in done),
                    "floor_s": floor_s(mode, fwd_bwd, opt, param_bytes, nproc, copy_bps, cores),
                }
            )
            if mode.startswith("fsdp"):
                line = floor.fsdp_floor_line(
                    statistics.median(steps),
                    fwd_bwd + opt / nproc,
                    param_bytes,
                    nproc,
                    copy_bps,
                    cores,
                    mode != "fsdp-slots",
                )
                lines.append(f"{mode}: {line}")
    mib = 2**20
    print(
        f"{ns.workload}: per-rank bytes (largest rank), MiB; model state = parameters + gradients + "
        "optimizer state; peak = each rank's peak RSS from process start (GPU: max allocated)"
    )
    print(
        "| ranks | mode | parameters | gradients | optimizer state | model state | x DDP | peak per rank "
        "| peak x DDP | step (s) [min, max] | step x DDP | floor (s) | step x floor "
        "| faults / step (sys ms) | shared RSS (MiB) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        ddp = next(r for r in rows if r["nproc"] == row["nproc"] and r["mode"] == "ddp")
        peaks = " / ".join(f"{p / mib:.0f}" for p in row["peaks"])
        print(
            f"| {row['nproc']} | {row['mode']} | {row['params'] / mib:.1f} | {row['grads'] / mib:.1f} | "
            f"{row['optimizer'] / mib:.1f} | {row['model_state'] / mib:.1f} | "
            f"{row['model_state'] / ddp['model_state']:.2f} | {peaks} | {row['peak'] / ddp['peak']:.2f} | "
            f"{row['step_s']:.3f} [{row['step_min']:.3f}, {row['step_max']:.3f}] | "
            f"{row['step_s'] / ddp['step_s']:.2f} | "
            + (
                f"{row['floor_s']:.3f} | {row['step_s'] / row['floor_s']:.2f} |"
                if row["floor_s"]
                else "- | - |"
            )
            + f" {row['faults']:.0f} ({row['sys_s'] * 1e3:.0f}) | {row['shmem'] / mib:.0f} |"
        )
    for line in lines:
        print(line)
    print(f"load average {os.getloadavg()[0]:.2f}")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
