"""DistributedDataParallel: every rank holds the whole model; gradients are all-reduced in backward.

DDP broadcasts global rank 0's parameters and buffers once, when it is built. Micro-batches skip the
all-reduce with DDP's `no_sync`; the clipped norm is the same everywhere because every rank clips the
same averaged gradients; checkpoints save rank 0's replica; `join` shadows the all-reduces of ranks
that ran out of data (torch's `Join`).

Construction (`wrap_model`, also what `Single` does with one process): to the device, SyncBatchNorm on
request (torch's `nn.SyncBatchNorm` on CUDA; on CPU, where DDP refuses torch's, ddpkit's own,
`ddpkit.parallel.syncbn`), DDP only when there are peers; a communication hook by name right after
wrapping (`ddpkit.parallel.comm_hooks`). With one process every DDP option gets a defined meaning
(logged once): accepted, without effect, because a single replica already computes the full-batch
gradient.

DataParallel is not a mode: one process driving several GPUs with threads copies the model to every
GPU on every step and serialises on the Python interpreter; DDP (one process per GPU) replaced it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddpkit.errors import problem
from ddpkit.parallel.modules import ddp_of
from ddpkit.parallel.precision import PrecisionPlan
from ddpkit.parallel.shape import Shape
from ddpkit.parallel.syncbn import convert_batchnorm, has_batchnorm
from ddpkit.strategy.base import Strategy
from ddpkit.strategy.ddp_options import DDPOptions


def wrap_model(
    module: nn.Module,
    *,
    device: torch.device,
    distributed: bool,
    options: DDPOptions,
) -> tuple[nn.Module, list[str]]:
    """Prepare `module` for training; return the model to train and notes worth logging once."""
    sync_batchnorm, comm_hook = options.sync_batchnorm, options.comm_hook
    if isinstance(module, DistributedDataParallel):
        raise problem(
            "the model is already wrapped in DistributedDataParallel",
            "Pass the plain nn.Module; ddpkit wraps it when the world size is above 1",
        )
    notes: list[str] = []
    module = module.to(device)
    if not distributed:
        if sync_batchnorm and has_batchnorm(module):
            notes.append("sync_batchnorm: one process, BatchNorm already sees the whole batch; kept as is")
        changed = {k: v for k, v in options.ddp_kwargs().items() if v != _DEFAULTS.get(k, True)}
        if changed:
            notes.append(f"DDP options {changed} have no effect with one process (no gradients to average)")
        if comm_hook is not None:
            notes.append(f"comm_hook={comm_hook!r} has no effect with one process (nothing to communicate)")
        return module, notes
    if sync_batchnorm:
        module = convert_batchnorm(module, device.type)
    elif has_batchnorm(module):
        notes.append(
            "BatchNorm computes statistics per rank (per-rank batch); pass sync_batchnorm=True for "
            "statistics over the global batch"
        )
    device_ids = [device.index] if device.type == "cuda" else None
    ddp = DistributedDataParallel(module, device_ids=device_ids, **options.ddp_kwargs())
    if comm_hook is not None:
        from ddpkit.parallel import comm_hooks  # imported when a hook is asked for

        state = comm_hooks.register(ddp, comm_hook, options.comm_hook_options)
        if getattr(state, "active", True) is False:  # e.g. "shm" across machines: say why, once
            notes.append(f"comm_hook={comm_hook!r}: {state.reason}")
    return ddp, notes


_DEFAULTS = DDPOptions().ddp_kwargs()


def build(options: DDPOptions | None, shape: Shape, precision: PrecisionPlan) -> DDP:
    """The registered builder (`ddpkit.strategy.registry`): DDP needs only its options."""
    return DDP(options)


class DDP(Strategy):
    name = "ddp"
    allows_sharded_step = True

    def __init__(self, options: DDPOptions | None = None) -> None:
        super().__init__()
        self.options = options or DDPOptions()

    def describe(self) -> str:
        return "DistributedDataParallel"

    def wrap(self, module: nn.Module, device: torch.device, options: object = None) -> nn.Module:
        """`options`: this model's own `DDPOptions` (`s.model`'s keywords), else the strategy's."""
        own = options if isinstance(options, DDPOptions) else self.options
        model, notes = wrap_model(module, device=device, distributed=True, options=own)
        self.notes.extend(notes)
        return model

    def owns(self, model: nn.Module) -> bool:
        return ddp_of(model) is not None

    def skip_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        ddp = ddp_of(model)
        return ddp.no_sync() if ddp is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def join(self, model: nn.Module, joinables: tuple[Any, ...]) -> Iterator[None]:
        from torch.distributed.algorithms.join import Join

        self.expect(model, "s.join")
        ddp: Any = ddp_of(model)  # a DDP module: `expect` has just checked it
        with Join([ddp, *joinables], divide_by_initial_world_size=False):
            yield
