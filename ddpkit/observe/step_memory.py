"""torch's memory tracker on one training step, folded into the categories of a `Breakdown`; the
helpers a step on fake tensors needs (the optimizer's state made first, ZeRO-1's owned update), and a
model's skeleton on the meta device from which such a step builds a fake copy.

    tracker = peak_tracker(model, opt, sharded=False)     # MemTracker (FSDPMemTracker for FSDP2)
    with tracker:
        ...one step...
    b = fold(tracker, opt)                                 # parameters, gradients, ..., activations

Why here, below the session and the plan: `ddpkit plan --memory` (`ddpkit.plan.memory`) runs a step of a
model it builds on fake tensors, `ddpkit.plan.memory_live` tracks a live step, and a session with
`micro_batch="auto"` under FSDP (`ddpkit.training.oom_ahead`) estimates its own first step before it
runs it; all three use the same tracker and the same fold, so their figures read side by side.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ddpkit.observe.memory_breakdown import Breakdown

# What a device holds beyond the tracked peak (`ddpkit plan --memory`'s devices, `ddpkit.plan.devices`,
# and the split chosen ahead, `ddpkit.training.oom_ahead`, use the same figures):
CUDA_RESERVED = 1 << 30  # the CUDA context (~500 MiB on an H100 with torch 2.x) and NCCL's buffers
CUDA_ALLOWANCE = 0.10  # the caching allocator's rounding and cached blocks above the allocated peak
CPU_ALLOWANCE = 0.10  # glibc's heap above the live tensors, with glibc's defaults (docs/planning.md)
CPU_RESERVED = 400 * (1 << 20)  # a rank's own RSS before its first tensor: torch, gloo, Python (measured)


def skeleton(module: nn.Module) -> nn.Module:
    """A copy of `module` on the meta device: its classes, hooks-free structure and tensor shapes, no
    storage (each parameter and buffer replaced by a meta tensor of its shape, ties kept). Cheap: no
    tensor data is copied."""
    memo: dict[int, Any] = {}
    for t in itertools.chain(module.parameters(), module.buffers()):
        if id(t) in memo:
            continue
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = _like(t, meta)
    return copy.deepcopy(module, memo)


def _like(t: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    return nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new


def materialize(meta: nn.Module, device: torch.device) -> nn.Module:
    """A copy of a `skeleton` whose tensors are allocated on `device`: under `FakeTensorMode`, fake
    tensors (shapes and dtypes, no memory); ties kept."""
    module = copy.deepcopy(meta)
    made: dict[int, torch.Tensor] = {}
    for sub in module.modules():
        tables: tuple[dict[str, Any], ...] = (sub._parameters, sub._buffers)
        for table in tables:
            for name, t in table.items():
                if t is None:
                    continue
                if id(t) not in made:
                    new = torch.empty(t.shape, dtype=t.dtype, device=device)
                    made[id(t)] = _like(t, new)
                table[name] = made[id(t)]
    return module


def set_aside(params: list[nn.Parameter], owned: set[int] | None) -> list[tuple[nn.Parameter, Any]]:
    """The sharded step's trick: the gradients of parameters this rank does not own are hidden from
    optimizer.step() (every torch optimizer skips a parameter whose grad is None)."""
    if owned is None:
        return []
    away = [(p, p.grad) for p in params if id(p) not in owned]
    for p, _ in away:
        p.grad = None
    return away


def warm_optimizer(
    params: list[nn.Parameter], opt: torch.optim.Optimizer, owned: set[int] | None, keep_grads: bool
) -> None:
    """One update on zero gradients, untracked: the optimizer's state exists before the tracked step,
    as in every step after the first (cheaper than a whole warm-up step: no forward, no backward; FSDP's
    lazy initialisation in the tracked step's first forward allocates nothing that stays)."""
    for p in params:
        p.grad = torch.zeros_like(p)  # DDP: its buckets, allocated at the wrap and kept (keep_grads)
    owned_update(params, opt, owned, keep_grads)


def owned_update(
    params: list[nn.Parameter], opt: torch.optim.Optimizer, owned: set[int] | None, keep_grads: bool
) -> None:
    """The optimizer step on this rank's own parameters (ZeRO-1: the others' gradients set aside, so the
    step keeps no state for them), then zero_grad as the strategy does it."""
    away = set_aside(params, owned)
    opt.step()
    for p, g in away:
        p.grad = g
    opt.zero_grad(set_to_none=not keep_grads)


def peak_tracker(model: nn.Module, opt: torch.optim.Optimizer, *, sharded: bool) -> Any:
    """torch's memory tracker for one step of `model` and `opt` (FSDPMemTracker for an FSDP2 model),
    keeping only the step's peak: the same tracker for fake tensors (the plan) and real ones
    (`ddpkit.plan.memory_live`)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    class _Peak:
        """Only the step's peak, not every module's: torch's trackers update each active module's own
        peak at every op (`_update_peak_stats`), two thirds of a GPT-2 step's time; the step's peak and
        its categories are computed exactly as torch does."""

        _curr_mem_snap: dict[Any, dict[Any, int]]
        _peak_mem: dict[Any, int]
        _peak_mem_snap: dict[Any, dict[Any, int]]

        def _update_peak_stats(self, peak_state: Any) -> None:
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap["Total"]:
                    self._peak_mem[dev] = snap["Total"]
                    self._peak_mem_snap[dev] = dict(snap)

    class _Tracker(_Peak, MemTracker):
        pass

    class _FSDPTracker(_Peak, FSDPMemTracker):
        pass

    if sharded:
        return _FSDPTracker(model, opt)
    tracker = _Tracker()
    tracker.track_external(model, opt)
    return tracker


def fold(tracker: Any, opt: torch.optim.Optimizer) -> Breakdown:
    """The tracker's peak as a `Breakdown`."""
    b = Breakdown.from_snapshot(tracker.get_tracker_snapshot("peak"))
    # torch's trackers count everything allocated inside optimizer.step() as optimizer state; what
    # is not in the optimizer's state afterwards (AdamW's per-tensor scratch) is a temporary
    extra = b.optimizer_state - state_bytes(opt)
    if extra > 0:
        b = replace(b, optimizer_state=b.optimizer_state - extra, temporaries=b.temporaries + extra)
    return b


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's state tensors (DTensors by their local shard), each storage once."""
    seen: dict[int, int] = {}
    for state in opt.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if hasattr(value, "to_local") else value
                storage = local.untyped_storage()
                seen[id(storage)] = storage.nbytes()
    return sum(seen.values())
