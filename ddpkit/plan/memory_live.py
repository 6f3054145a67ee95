"""Where a running step's peak memory went, on demand: torch's memory tracker on the step's real
tensors, folded into the categories of `ddpkit plan --memory`.

    from ddpkit.plan.memory_live import track_step

    with track_step(model, opt) as step:         # one step of your loop, as it is
        with s.accumulate(model):
            s.backward(loss_fn(model, batch))
        s.step(opt)
    print(step.breakdown.text())                  # parameters, gradients, optimizer state, activations, ...

The same tracker and the same fold as the plan (`ddpkit.observe.step_memory.peak_tracker`, `fold`), so a live
step and its estimate are read side by side; the plan's validation compares exactly these
(docs/planning.md). It costs what torch's tracker costs (a dispatch hook on every op of the tracked
step, several times the step's time on small CPU steps): track one step, not every step. What it sees
is what tensors hold; the allocator's rounding and cached blocks, the CUDA context and memory held
outside torch's allocator are not in it (the plan's allowance and reserve stand for those). At an
out-of-memory error under `micro_batch="auto"` ddpkit says a cheaper breakdown of its own, at the
moment of the failure (`ddpkit.step.oom.describe_where`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ddpkit.observe.memory_breakdown import Breakdown
from ddpkit.observe.step_memory import fold, peak_tracker


@dataclass
class TrackedStep:
    """Filled when the `track_step` block ends: the tracked peak by category."""

    breakdown: Breakdown | None = None


@contextlib.contextmanager
def track_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[TrackedStep]:
    """Track the block's tensors (the model's, the optimizer's and everything the block allocates) and
    fill `.breakdown` with the peak at the block's end. An FSDP2 model (`fully_shard`) is tracked with
    torch's FSDPMemTracker (its all-gather buffers as their own category)."""
    from torch.distributed.fsdp import FSDPModule

    inner = getattr(model, "module", model)  # DDP's wrapped module: its parameters are the same
    sharded = isinstance(model, FSDPModule) or isinstance(inner, FSDPModule)
    tracker = peak_tracker(inner if sharded else model, optimizer, sharded=sharded)
    out = TrackedStep()
    with tracker:
        yield out
    out.breakdown = fold(tracker, optimizer)
