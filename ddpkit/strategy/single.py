"""One process: the model on its device, nothing to synchronise.

Every DDP option gets a defined meaning here (logged once): accepted, without effect, because a single
replica already computes the full-batch gradient.
"""

from __future__ import annotations

import torch
from torch import nn

from ddpkit.strategy.base import Strategy
from ddpkit.strategy.ddp import wrap_model
from ddpkit.strategy.ddp_options import DDPOptions


class Single(Strategy):
    name = "single"

    def __init__(self, options: DDPOptions | None = None, *, asked: str | None = None) -> None:
        super().__init__()
        self.options = options or DDPOptions()
        self.asked = asked  # "ddp" or "fsdp" asked for with one process: said once

    def wrap(self, module: nn.Module, device: torch.device, options: object = None) -> nn.Module:
        if self.asked is not None:
            self.notes.append(f"strategy={self.asked!r} with one process: trained as is (nothing to shard)")
        ddp = options if isinstance(options, DDPOptions) else self.options  # FSDPOptions: nothing to say
        model, notes = wrap_model(module, device=device, distributed=False, options=ddp)
        self.notes.extend(notes)
        return model
