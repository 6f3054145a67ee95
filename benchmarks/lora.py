"""LoRA against full fine-tuning under DDP and FSDP: per-rank peak memory, step time, and the gradient
bytes each rank hands to the reduction per step, against the adapters' size.

    python benchmarks/lora.py                                   # 2 GPT-2 124M-shaped layers, 2 ranks
    python benchmarks/lora.py --layers 12 --rounds 2 --steps 3  # the whole 124M model (slow on CPU ranks)
    python benchmarks/lora.py --modes fsdp1-lora --rounds 1     # torch's FSDP1 (use_orig_params=True)

The model: `GPT2LMHeadModel` of GPT-2 124M's shape (768 wide, 12 heads, vocabulary 50257, tied head) with
`--layers` blocks, built from its config (the weights' values do not matter here; `weights=` would read a
pretrained base into the same shards), dropout off. LoRA: peft's `LoraConfig(r=--rank, target_modules=
["c_attn"])`, GPT-2's usual target. Each rank trains on its own `--rows` x `--seq` random tokens per step,
AdamW (lr 1e-4) given `model.parameters()` as scripts do (the frozen base gets no state).

Modes (each run in 2 fresh ranks, "spawn", 1 thread each; `--rounds` runs the modes interleaved, a, b,
c, d, a, b, ...): ddp-full, ddp-lora (`s.model(build, strategy="ddp")`, ddpkit's sharded optimizer step
off so that every DDP rank holds the whole optimizer state, as DDP does), fsdp-full, fsdp-lora
(`strategy="fsdp"`: units chosen by size, collectives through shared memory, `ddpkit.parallel.fsdp_shm`);
and, on request, fsdp1-lora: torch's `FullyShardedDataParallel(use_orig_params=True)`, one unit per
`GPT2Block` (what litgpt and Accelerate set up), to show what a frozen/trainable mix in one FSDP1 unit
reduces (GPU ranks only: torch 2.13's FSDP1 refuses CPU). Measured per rank:

- peak: RSS high-water mark during the timed steps (`VmHWM` reset after the build through
  `/proc/self/clear_refs`), and the build's peak (`ru_maxrss` after `s.model`), both minus the RSS just
  before `s.model` (torch, transformers, peft and the session are the same in every mode);
- model state: parameter, gradient (after a backward) and optimizer-state bytes, from the tensors (FSDP's
  DTensors by their local shard);
- step: wall clock on rank 0 between barriers, the median of `--steps` steps after one warm-up step;
- reduced: the gradient bytes handed to the reduction per optimizer step, counted at the collective:
  DDP's all-reduce buckets (a counting comm hook wrapping `allreduce_hook`, registered after `s.model`),
  FSDP2's reduce-scatter input (the unsharded gradients of each unit) and all-gather output (parameters,
  for forward and backward), counted in `ShmComms`; FSDP1's `dist.reduce_scatter_tensor` input.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

import ddpkit

MODES = ("ddp-lora", "ddp-full", "fsdp-lora", "fsdp-full")
EXTRA = ("fsdp1-lora", "fsdp1-full")
MIB = 2**20


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(f"{key}:"))


def _reset_peak() -> bool:
    """Reset this process's RSS high-water mark (`VmHWM`), Linux >= 4.0; False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _local_bytes(t: Any) -> int:
    if t is None:
        return 0
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


class Counter:
    """Bytes handed to each collective, by kind, in this rank."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {"reduce": 0, "gather": 0}
        self.calls: dict[str, int] = {"reduce": 0, "gather": 0}

    def add(self, kind: str, t: Any) -> None:
        self.bytes[kind] += t.numel() * t.element_size()
        self.calls[kind] += 1

    def snapshot(self) -> tuple[dict[str, int], dict[str, int]]:
        return dict(self.bytes), dict(self.calls)


def _count_fsdp(counter: Counter) -> None:
    """Count FSDP2's collectives in ddpkit's shared-memory path and torch's own (FSDP1, gloo)."""
    import torch.distributed as dist

    from ddpkit.parallel import fsdp_shm

    rs, ag = fsdp_shm.ShmComms.reduce_scatter, fsdp_shm.ShmComms.all_gather
    inside = {"shm": False}

    def reduce_scatter(self, output, input, group, op, async_op=False):
        counter.add("reduce", input)
        inside["shm"] = True
        try:
            return rs(self, output, input, group, op, async_op)
        finally:
            inside["shm"] = False

    def all_gather(self, output, input, group, async_op=False):
        counter.add("gather", output)
        inside["shm"] = True
        try:
            return ag(self, output, input, group, async_op)
        finally:
            inside["shm"] = False

    fsdp_shm.ShmComms.reduce_scatter = reduce_scatter  # type: ignore[method-assign]
    fsdp_shm.ShmComms.all_gather = all_gather  # type: ignore[method-assign]
    d_rs, d_ag = dist.reduce_scatter_tensor, dist.all_gather_into_tensor

    def dist_reduce_scatter(output, input, *args, **kwargs):
        if not inside["shm"]:  # a fallback inside ShmComms is counted there
            counter.add("reduce", input)
        return d_rs(output, input, *args, **kwargs)

    def dist_all_gather(output, input, *args, **kwargs):
        if not inside["shm"]:
            counter.add("gather", output)
        return d_ag(output, input, *args, **kwargs)

    dist.reduce_scatter_tensor = dist_reduce_scatter
    dist.all_gather_into_tensor = dist_all_gather


def _counting_hook(counter: Counter) -> Callable:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def hook(state, bucket):  # no annotations: DDP compares them to its own types
        counter.add("reduce", bucket.buffer())
        return allreduce_hook(state, bucket)

    return hook


def _build(layers: int, seq: int, lora: bool, rank: int) -> Callable[[], Any]:
    import transformers as tf

    cfg = tf.GPT2Config(
        n_layer=layers,
        n_embd=768,
        n_head=12,
        n_positions=seq,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )

    def build() -> Any:
        model = tf.GPT2LMHeadModel(cfg)
        if not lora:
            return model
        from peft import LoraConfig, get_peft_model

        return get_peft_model(
            model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["c_attn"], lora_dropout=0.0)
        )

    return build


def _fsdp1(module: Any) -> Any:
    """torch's FSDP1 as litgpt/Accelerate set it up for LoRA: one unit per block, use_orig_params=True
    (needed for a frozen/trainable mix in one unit)."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    return FullyShardedDataParallel(
        module, auto_wrap_policy=ModuleWrapPolicy({GPT2Block}), use_orig_params=True
    )


def _rank(mode: str, layers: int, seq: int, rows: int, steps: int, lora_rank: int) -> dict:
    import torch

    from ddpkit.strategy import FSDPOptions

    strategy, kind = mode.split("-")
    counter = Counter()
    if strategy.startswith("fsdp"):
        _count_fsdp(counter)
    build = _build(layers, seq, kind == "lora", lora_rank)
    with ddpkit.session(seed=0, verbose=False, shard_optimizer=False) as s:
        s.barrier()
        before = _status("VmRSS")
        start = time.perf_counter()
        if strategy == "fsdp1":
            whole = build()
            counts = (
                sum(p.numel() for p in whole.parameters() if p.requires_grad),
                sum(p.numel() for p in whole.parameters()),
            )
            model = _fsdp1(whole)
            del whole
        else:
            model = s.model(build, strategy=FSDPOptions() if strategy == "fsdp" else "ddp")
            inner = ddpkit.unwrap(model).parameters
            counts = (sum(p.numel() for p in inner() if p.requires_grad), sum(p.numel() for p in inner()))
        if strategy == "ddp":
            model.register_comm_hook(None, _counting_hook(counter))
        s.barrier()
        build_s = time.perf_counter() - start
        build_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        params = list(model.parameters())
        trainable, total = counts
        opt = torch.optim.AdamW(params, lr=1e-4)
        g = torch.Generator().manual_seed(1000 + s.rank)
        batches = [torch.randint(0, 50257, (rows, seq), generator=g) for _ in range(steps + 1)]
        reset = _reset_peak()
        times, grads, at_warm = [], 0, counter.snapshot()
        for i, ids in enumerate(batches):
            s.barrier()
            if i == 1:
                at_warm = counter.snapshot()
            t0 = time.perf_counter()
            with s.accumulate(model):
                s.backward(model(input_ids=ids, labels=ids).loss)
            if i == 0:
                grads = sum(_local_bytes(p.grad) for p in params)
            s.step(opt)
            s.barrier()
            if i > 0:
                times.append(time.perf_counter() - t0)
        step_peak = _status("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        done = counter.snapshot()
        state = sum(_local_bytes(v) for st in opt.state.values() for v in st.values() if torch.is_tensor(v))
        return {
            "before": before,
            "build_peak": build_peak,
            "step_peak": step_peak,
            "peak_reset": reset,
            "build_s": build_s,
            "step_s": statistics.median(times),
            "params": sum(_local_bytes(p) for p in params),
            "grads": grads,
            "optimizer": state,
            "trainable": trainable,
            "total": total,
            "reduced": (done[0]["reduce"] - at_warm[0]["reduce"]) / steps,
            "reduce_calls": (done[1]["reduce"] - at_warm[1]["reduce"]) / steps,
            "gathered": (done[0]["gather"] - at_warm[0]["gather"]) / steps,
        }


def _spread(values: list[float], fmt: str) -> str:
    mid = statistics.median(values)
    return f"{fmt.format(mid)} [{fmt.format(min(values))}, {fmt.format(max(values))}]"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--rows", type=int, default=2, help="rows per rank per step")
    p.add_argument("--steps", type=int, default=4, help="timed steps per run (after one warm-up)")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank r")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modes", nargs="+", choices=MODES + EXTRA, default=list(MODES))
    p.add_argument("--json", default=None)
    ns = p.parse_args()
    print(f"load average {os.getloadavg()}; {len(os.sched_getaffinity(0))} cores", flush=True)
    runs: dict[str, list[list[dict]]] = {m: [] for m in ns.modes}
    loads = []
    for _ in range(ns.rounds):
        for mode in ns.modes:
            args = (mode, ns.layers, ns.seq, ns.rows, ns.steps, ns.rank)
            runs[mode].append(ddpkit.spawn(_rank, ns.nproc, args, threads=1, timeout=900))
            loads.append(os.getloadavg()[0])
            r0 = runs[mode][-1][0]
            grew = (r0["step_peak"] - r0["before"]) / MIB
            print(
                f"  {mode}: step {r0['step_s']:.3f} s, step peak {grew:.0f} MiB, reduced "
                f"{r0['reduced'] / MIB:.2f} MiB/step (load {loads[-1]:.2f})",
                flush=True,
            )
    first = runs[ns.modes[0]][0][0]
    print(
        f"\nGPT-2 124M-shaped, {ns.layers} layer(s) x 768, vocabulary 50257: {first['total'] / 1e6:.1f}M "
        f"parameters; LoRA r={ns.rank} on c_attn; {ns.nproc} ranks x 1 thread, {ns.rows} x {ns.seq} tokens "
        f"per rank per step, AdamW; {ns.rounds} round(s) x {ns.steps} timed steps; load average during the "
        f"runs {min(loads):.2f}-{max(loads):.2f}"
    )
    print(
        "| mode | trainable | step peak - RSS before s.model (MiB, per rank) | "
        "build peak - RSS before (MiB) | "
        "params + grads + optimizer state (MiB, rank 0) | step (s), median [min, max] of runs | "
        "gradient bytes reduced / step (MiB) | x adapter fp32 bytes | "
        "all-gathered / step (MiB) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for mode, done in runs.items():
        r0s = [ranks[0] for ranks in done]
        step_peaks = [max(r["step_peak"] - r["before"] for r in ranks) / MIB for ranks in done]
        build_peaks = [max(r["build_peak"] - r["before"] for r in ranks) / MIB for ranks in done]
        r = r0s[0]
        adapter = r["trainable"] * 4
        state = (r["params"] + r["grads"] + r["optimizer"]) / MIB
        row = {"mode": mode, "runs": [[dict(x) for x in ranks] for ranks in done]}
        rows.append(row)
        print(
            f"| {mode} | {r['trainable'] / 1e6:.2f}M of {r['total'] / 1e6:.1f}M | "
            f"{_spread(step_peaks, '{:.0f}')} | "
            f"{_spread(build_peaks, '{:.0f}')} | {r['params'] / MIB:.0f} + {r['grads'] / MIB:.0f} + "
            f"{r['optimizer'] / MIB:.0f} = {state:.0f} | {_spread([x['step_s'] for x in r0s], '{:.3f}')} | "
            f"{r['reduced'] / MIB:.2f} ({r['reduce_calls']:.0f} calls) | {r['reduced'] / adapter:.2f} | "
            f"{r['gathered'] / MIB:.0f} |"
        )
    print(f"load average at the end {os.getloadavg()}")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
