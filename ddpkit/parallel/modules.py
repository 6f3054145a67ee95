"""Helpers on wrapped modules that every strategy, the stepper and checkpoints share: the user's module
inside DDP and torch.compile wrappers (`unwrap`), and the DDP wrapper itself (`ddp_of`).

They only look at a module's type, so they sit below the strategies (which build the wrappers) and the
step (which asks them): neither needs to import the other for these.
"""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel


def ddp_of(model: nn.Module) -> DistributedDataParallel | None:
    """The DDP wrapper of `model` (also under any number of torch.compile wrappers), or None."""
    while not isinstance(model, DistributedDataParallel):
        inner = getattr(model, "_orig_mod", None)  # torch.compile's OptimizedModule
        if not isinstance(inner, nn.Module):
            return None
        model = inner
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside any nesting of DDP and torch.compile wrappers: keys without `module.`.

    Both orders users write are covered: `DDP(torch.compile(net))` (compile inside, torch's guidance
    and `s.model(net, compile=True)`) and `torch.compile(DDP(net))` (compile outside).
    """
    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch.compile's OptimizedModule
            model = model._orig_mod  # type: ignore[assignment]  # checked to be a module just above
        else:
            return model
