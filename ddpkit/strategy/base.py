"""What "data parallel" means for one kind of training: the interface every strategy implements.

    strategy = ddpkit.strategy.make("fsdp", shape, precision=plan)   # the session does this, once
    model = strategy.wrap(net, device)         # to the device; DDP, FSDP2 or nothing
    with strategy.skip_sync(model):            # micro-batches 1..k-1 of an accumulation group
        loss.backward()
    norm = strategy.clip(params, max_norm)     # the total norm, identical on every rank
    weights = strategy.full_state(model)       # checkpoints: the full weights on global rank 0

Everything that differs between one device, DDP and FSDP lives behind this seam, so that the session,
the stepper, checkpoints, verify and trace ask the strategy instead of testing for DDP: also the checks
that belong to a kind (`check_compile`: may it wrap a compiled module; `check_loadable`: what a
checkpoint saved by another strategy may restore into it). A strategy carries its own options
(`DDPOptions`, `FSDPOptions`). Strategies are named by plain strings ("single", "ddp", "fsdp"; the
built-in list is `ddpkit.names.STRATEGIES`, which is also what `plan` and `doctor` speak); a strategy of
your own is a subclass, registered by name (`ddpkit.strategy.register`) or passed as an instance.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from ddpkit.errors import problem
from ddpkit.parallel.modules import unwrap
from ddpkit.strategy import adapters

# A module's attribute, set when it is wrapped, naming the context its training step must run in (the
# forward, the loss and the backward) and its evaluation's forward and loss: `Strategy.loss_context`.
LOSS_CONTEXT = "_ddpkit_loss_context"


class Strategy:
    """The single-device behaviour; DDP and FSDP override what differs."""

    name: ClassVar[str] = "single"
    shards_state: ClassVar[bool] = False  # model and optimizer state live in shards (checkpoints via DCP)
    allows_sharded_step: ClassVar[bool] = False  # ddpkit.step.sharding may split the optimizer step
    grads_between_micro_batches: ClassVar[bool] = True  # skipped-sync gradients sit in `p.grad`
    collective_forward: ClassVar[bool] = False  # the eval module's forward is a collective (FSDP)

    def __init__(self) -> None:
        self.notes: list[str] = []  # things worth logging once, gathered while wrapping

    def describe(self) -> str:
        return self.name

    # -- the model ----------------------------------------------------------------------------------
    def build(self, factory: Callable[[], nn.Module]) -> nn.Module:
        """The module a factory passed to `s.model` makes: simply called here; FSDP builds it shard by
        shard so that no rank holds the whole model."""
        return factory()

    def wrap(self, module: nn.Module, device: torch.device, options: object = None) -> nn.Module:
        """Prepare `module` for training on `device`; the model the user trains. `options`: this
        model's own options (`s.model(net, strategy=DDPOptions(...))`), else the strategy's."""
        return module.to(device)

    def close(self) -> None:
        """Release what `wrap` set up for the session (FSDP: its shared-memory segment); safe twice."""

    def keep_blueprints(self) -> None:
        """Keep how each model is wrapped, without its data, for an estimate of its first step on fake
        tensors (`micro_batch="auto"`); a strategy with nothing to rebuild keeps nothing."""

    def blueprint(self, model: nn.Module) -> object | None:
        """What `keep_blueprints` kept for `model` (FSDP: its `Blueprint`), or None."""
        return None

    def check_compile(self) -> None:
        """Raise a clear error when this strategy cannot wrap a torch.compile'd module."""

    def check_loadable(self, saved: str, optimizers: Collection[str], path: object) -> None:
        """Raise a clear error when a checkpoint saved with strategy `saved` cannot restore these
        optimizers into this strategy (the weights always can)."""

    def owns(self, model: nn.Module) -> bool:
        """True if `model` is what `wrap` returned (a check against passing the inner module)."""
        return True

    def expect(self, model: nn.Module, where: str) -> None:
        """Raise a clear error when `model` is not the wrapped model (its gradients would not sync)."""
        if not self.owns(model):
            raise problem(
                f"{where} got a {type(model).__name__}, not the {self.describe()} model",
                "Pass the model that s.model(...) returned, so that its gradient synchronisation is handled",
            )

    def eval_module(self, model: nn.Module) -> nn.Module:
        """The module to evaluate with: no collective in its forward (so per-rank shards may differ)."""
        return unwrap(model)

    # -- a training step ----------------------------------------------------------------------------
    def loss_context(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """The context `model`'s forward, loss and backward run in (`fit` enters it for its step and its
        evaluation): the one its wrapping asked for, else none. Per model, since a model's own options
        may differ from the session's: tensor parallelism's loss parallel asks for torch's
        `loss_parallel()` (`ddpkit.strategy.tp_loss`)."""
        made = getattr(unwrap(model), LOSS_CONTEXT, None)
        return made() if made is not None else contextlib.nullcontext()

    def skip_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Inside: backward accumulates gradients locally (micro-batches 1..k-1)."""
        return contextlib.nullcontext()

    def clip(self, params: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
        """Clip gradients to a total 2-norm of `max_norm`; the norm before clipping."""
        return nn.utils.clip_grad_norm_(list(params), max_norm)

    def join(self, model: nn.Module, joinables: tuple[object, ...]) -> contextlib.AbstractContextManager:
        """Inside: ranks may run out of batches at different times without hanging."""
        return contextlib.nullcontext()  # one process: nobody to wait for

    # -- checkpoints --------------------------------------------------------------------------------
    def full_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The full weights (keys without `module.`) on global rank 0; a collective where sharded. A PEFT
        model: its trainable tensors only (`ddpkit.strategy.adapters.saved_state`)."""
        inner = unwrap(model)
        return adapters.saved_state(inner, inner.state_dict())

    def load_full_state(self, model: nn.Module, state: Mapping[str, torch.Tensor], *, strict: bool) -> None:
        """Load full weights read on every rank (a collective where sharded)."""
        inner = unwrap(model)
        inner.load_state_dict(state, strict=adapters.check_loadable(inner, state, strict=strict))

    def write_full_state(self, model: nn.Module, path: Path, rank: int) -> int:
        """Stream the full weights to one safetensors file (rank 0 writes; every rank calls), for
        strategies whose shards must not be gathered whole on one rank; the number of tensors."""
        raise NotImplementedError(f"the {self.name} strategy keeps whole state: export its full_state")

    def sharded_state(self, model: nn.Module, optimizers: Mapping[str, torch.optim.Optimizer]) -> dict:
        """Model and optimizer state as this rank's shards, for torch.distributed.checkpoint."""
        raise NotImplementedError(f"the {self.name} strategy keeps whole state")

    def load_sharded_state(
        self, model: nn.Module, optimizers: Mapping[str, torch.optim.Optimizer], state: dict
    ) -> None:
        raise NotImplementedError(f"the {self.name} strategy keeps whole state")
