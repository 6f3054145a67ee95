"""DistributedDataParallel: every rank holds the whole model; gradients are all-reduced in backward.

DDP broadcasts global rank 0's parameters and buffers once, when it is built. Micro-batches skip the
all-reduce with DDP's `no_sync`; the clipped norm is the same everywhere because every rank clips the
same averaged gradients; checkpoints save rank 0's replica; `join` shadows the all-reduces of ranks
that ran out of data (torch's `Join`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ddpkit.step.wrap import DDPOptions, ddp_of, wrap_model
from ddpkit.strategy.base import Strategy


class DDP(Strategy):
    name = "ddp"
    allows_sharded_step = True

    def __init__(self, options: DDPOptions | None = None) -> None:
        super().__init__()
        self.options = options or DDPOptions()

    def describe(self) -> str:
        return "DistributedDataParallel"

    def wrap(self, module: nn.Module, device: torch.device, options: Any = None) -> nn.Module:
        """`options`: this model's own `DDPOptions` (`s.model`'s keywords), else the strategy's."""
        model, notes = wrap_model(module, device=device, distributed=True, options=options or self.options)
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
