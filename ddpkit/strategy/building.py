"""What `s.model` does to a module around the strategy's `wrap`, in order: build a factory, apply
activation checkpointing, check memory, read pretrained weights. It takes values (the session's strategy,
whether the optimizer step is sharded), never the session or the stepper.

    model = building.prepare(chosen, module, options, compiler, shard=..., ...)   # what s.model does:
    module = building.before_wrap(chosen, module, shard=..., ...)  # the whole (or meta, FSDP) module
    model = chosen.wrap(module, device, options)         # (compiled first, when asked)
    building.after_wrap(chosen, model, weights)          # FSDP: each rank reads its own rows

Weights (`ddpkit.strategy.weights`): a strategy that replicates the model reads them on global rank 0
only, before wrapping, because DDP's constructor broadcasts rank 0's weights anyway; a sharded one
(FSDP) reads them after `fully_shard`, each rank only its rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.parallel import compiling, cpu_allocator
from ddpkit.strategy import adapters, checkpointing, rank_memory, weights
from ddpkit.strategy.base import Strategy


def prepare(
    chosen: Strategy,
    module: nn.Module | Callable[[], nn.Module],
    options: object,
    compiler: compiling.CompileOptions | None,
    *,
    shard: bool | str,
    device: torch.device,
    weights_from: weights.Weights,
    recompute: checkpointing.Choice,
    world_size: int,
    distributed: bool,
    on_close: contextlib.ExitStack,
    say: Callable[[str], None],
) -> nn.Module:
    """`s.model`'s third question, how to prepare: build, compile (`compiler`: `compiling.CompileOptions`
    or None) and wrap `module` for the stepper's strategy, then read sharded weights; notes go to the
    strategy's `notes`, said (`say`) and cleared. `shard`: the session's shard_optimizer. `on_close`
    puts torch.compile's cache variables back at the session's end."""
    on_close.callback(chosen.close)  # what wrap set up for the session (FSDP: its shared memory); idempotent
    module = before_wrap(
        chosen,
        module,
        shard=shard,
        world_size=world_size,
        device=device,
        weights_from=weights_from,
        recompute=recompute,
    )
    if compiler is None:
        model = chosen.wrap(module, device, options)
    else:
        chosen.check_compile()
        on_close.callback(compiling.cache_env_restorer())
        blockwise = getattr(chosen, "wrap_compiling", None)  # FSDP: each block, before sharding
        per_block = None if blockwise is None else lambda m, c: blockwise(m, device, options, c)
        model, notes = compiling.apply(
            module,
            compiler,
            lambda m: chosen.wrap(m, device, options),
            distributed=distributed,
            per_block=per_block,
        )
        chosen.notes.extend(notes)
    after_wrap(chosen, model, weights_from)
    if shard is True and not chosen.allows_sharded_step and distributed:
        chosen.notes.append(
            f"shard_optimizer=True has no effect with strategy={chosen.name!r}: the "
            "optimizer state is already sharded"
        )
    for note in chosen.notes:
        say(f"ddpkit: {note}")
    chosen.notes.clear()
    return model


def before_wrap(
    chosen: Strategy,
    module: nn.Module | Callable[[], nn.Module],
    *,
    shard: bool | str,
    world_size: int,
    device: torch.device,
    weights_from: weights.Weights,
    recompute: checkpointing.Choice = None,
) -> nn.Module:
    """`chosen`: the session's strategy; `shard`: whether the session may shard the optimizer step."""
    sharded_step = chosen.allows_sharded_step and shard is not False
    if not isinstance(module, nn.Module):  # a factory: under FSDP, built shard by shard
        module = chosen.build(module)
    upcast = adapters.adapters_in_fp32(module)  # a PEFT model's 16-bit adapters: fp32 (the base as is)
    if upcast is not None:
        chosen.notes.append(upcast)
    if recompute is not None:  # before DDP/FSDP (and compile) see the module
        chosen.notes.append(checkpointing.apply(module, recompute))
    rank_memory.check_replicated(chosen, module, world_size, sharded_step=sharded_step)
    if device.type == "cpu" and not chosen.shards_state:  # FSDP: kept blocks would cost its peak
        cpu_allocator.fit_to(module)  # keep memory between steps only where the model gains from it
    first = not dist.is_initialized() or dist.get_rank() == 0
    if weights_from is not None and not chosen.shards_state and first:  # DDP broadcasts rank 0's weights
        count = weights.load_whole(module, weights_from)
        chosen.notes.append(
            f"read {count} tensors from {weights_from}"
            + (" on global rank 0 (DDP copies them to the other ranks)" if world_size > 1 else "")
        )
    return module


def after_wrap(chosen: Strategy, model: nn.Module, weights_from: weights.Weights) -> None:
    if weights_from is not None and chosen.shards_state:
        count = weights.load_rows(model, weights_from)
        chosen.notes.append(f"read {count} tensors from {weights_from}, each rank only its own rows")
