"""What `s.model` does to a module around the strategy's `wrap`, kept out of the session (its size cap):
build a factory, apply activation checkpointing, check memory, read pretrained weights.

    module = building.before_wrap(stepper, module, ...)  # the whole (or meta, FSDP) module
    model = chosen.wrap(module, device, options)
    building.after_wrap(chosen, model, weights)          # FSDP: each rank reads its own rows

Weights (`ddpkit.strategy.weights`): a strategy that replicates the model reads them on global rank 0
only, before wrapping, because DDP's constructor broadcasts rank 0's weights anyway; a sharded one
(FSDP) reads them after `fully_shard`, each rank only its rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.step import cpu_allocator
from ddpkit.strategy import checkpointing, rank_memory, weights
from ddpkit.strategy.base import Strategy


def before_wrap(
    stepper: Any, module: nn.Module | Callable[[], nn.Module], *, world_size: int,
    device: torch.device, weights_from: weights.Weights, recompute: Any = None,
) -> nn.Module:  # fmt: skip
    """`stepper`: the session's `ddpkit.step.stepping.Stepper` (its strategy, whether it shards the step)."""
    chosen: Strategy = stepper.strategy
    sharded_step = chosen.allows_sharded_step and stepper.shard is not False
    if not isinstance(module, nn.Module):  # a factory: under FSDP, built shard by shard
        module = chosen.build(module)
    if recompute is not None:  # before DDP/FSDP (and compile) see the module
        chosen.notes.append(checkpointing.apply(module, recompute))
    rank_memory.check_replicated(chosen, module, world_size, sharded_step=sharded_step)
    if device.type == "cpu" and not chosen.shards_state:  # FSDP: kept blocks would cost its peak
        cpu_allocator.fit_to(module)  # keep memory between steps only where the model gains from it
    first = not dist.is_initialized() or dist.get_rank() == 0
    if weights_from is not None and not chosen.shards_state and first:  # DDP broadcasts rank 0's weights
        count = weights.load_whole(module, weights_from)
        chosen.notes.append(f"read {count} tensors from {weights_from}" + (
            " on global rank 0 (DDP copies them to the other ranks)" if world_size > 1 else ""))  # fmt: skip
    return module


def after_wrap(chosen: Strategy, model: nn.Module, weights_from: weights.Weights) -> None:
    if weights_from is not None and chosen.shards_state:
        count = weights.load_rows(model, weights_from)
        chosen.notes.append(f"read {count} tensors from {weights_from}, each rank only its own rows")
