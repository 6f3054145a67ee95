"""Random draws under tensor parallelism equal to one process's (dropout, any seeded op), or refused.

The trap: on a CPU mesh DTensor has no random-number tracker, so a random op on a sharded DTensor runs on
each local shard with the same generator state: every shard draws the same mask, which one process never
does (on CUDA torch gives each shard its own Philox offset: different masks, still not one process's).
And a dropout between a column-wise layer and its row-wise partner (attention probabilities over split
heads) sees a plain local shard whose layout torch no longer knows.

`OneProcessDraws`, a TorchDispatchMode held while the TP model runs (forward, and the recompute of
activation checkpointing in backward: `install` enters it from module hooks), runs every seeded op whose
first argument is a DTensor on a full-size plain tensor with the process generator (the same on every
rank of a tensor group: ddpkit seeds by the data-parallel rank) and keeps this rank's slice: the draws,
and the generator's state after them, are one process's. A seeded draw on a plain tensor outside a
column/row pair is on a whole (replicated) tensor: one process's as it is. Inside a pair it is refused,
naming the layer, unless `TPOptions(random="per-shard")` accepts masks equal in distribution only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ddpkit.errors import problem


def draws(func: Any, args: tuple, kwargs: dict) -> bool:
    """True if this call consumes the generator: a seeded op, unless its dropout probability is 0 (CPU's
    flash attention is tagged seeded whatever its dropout_p) or it is a dropout in eval mode."""
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return False
    for i, argument in enumerate(func._schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(argument.name, argument.default_value)
        if argument.name == "dropout_p" and not value:
            return False
        if argument.name == "train" and value is False:
            return False
    return True


def _slice(full: torch.Tensor, spec: Any) -> torch.Tensor:
    """This rank's part of a full tensor laid out as `spec` (Shard placements cut as torch.chunk)."""
    out = full
    for dim_of_mesh, placement in enumerate(spec.placements):
        if placement.is_shard():
            size, rank = spec.mesh.size(dim_of_mesh), spec.mesh.get_local_rank(dim_of_mesh)
            parts = torch.chunk(out, size, dim=placement.dim)
            out = parts[rank] if rank < len(parts) else out.narrow(placement.dim, 0, 0)
    return out


class OneProcessDraws(TorchDispatchMode):
    """Seeded ops on DTensors drawn whole and sliced; seeded ops inside a column/row pair refused."""

    def __init__(self, policy: str = "one-process") -> None:
        super().__init__()
        self.policy = policy
        self.region: str | None = None  # the column-wise layer whose sharded output is live, if any
        self.full_draws = 0
        self.depth = 0  # module hooks entered (the mode is pushed at the outermost one)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not draws(func, args, kwargs):
            return func(*args, **kwargs)
        from torch.distributed.tensor import DTensor

        first = args[0] if args else None
        if isinstance(first, DTensor):
            return self._full_then_slice(func, first, args, kwargs)
        if self.region is not None and self.policy == "one-process":
            raise problem(
                f"a random draw ({func.__name__}) on the split output of {self.region!r}, between its "
                "column-wise layer and the row-wise one: each tensor-parallel rank holds part of that "
                "activation as a plain tensor, so ddpkit cannot give it the mask one process draws, and "
                "torch would draw the same mask on every shard",
                "Set that dropout to 0 (Hugging Face: config.attention_dropout=0.0), or pass "
                'TPOptions(random="per-shard") to accept masks equal to one process\'s in distribution only',
            )
        return func(*args, **kwargs)

    def _full_then_slice(self, func: Any, x: Any, args: tuple, kwargs: dict) -> Any:
        from torch.distributed.tensor import DTensor

        spec = x._spec
        if any(p.is_partial() for p in spec.placements):
            raise problem(
                f"a random draw ({func.__name__}) on a partial sum (a DTensor not reduced yet): no value of "
                "one process exists for it",
                "Draw after the row-wise layer's output is reduced (its output_layouts Replicate or Shard)",
            )
        self.full_draws += 1
        local = x._local_tensor
        if func._schema.is_mutable:  # in place: bernoulli_, uniform_, normal_
            full = torch.empty(x.shape, dtype=local.dtype, device=local.device)
            func(full, *args[1:], **kwargs)
            local.copy_(_slice(full, spec))
            return x
        source = x.full_tensor()  # out of place (native_dropout, bernoulli): its input matters
        out = func(source, *args[1:], **kwargs)

        def wrap(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            return DTensor.from_local(_slice(t, spec), spec.mesh, spec.placements, run_check=False)

        return tuple(wrap(t) for t in out) if isinstance(out, tuple) else wrap(out)


def install(model: nn.Module, columns: list[str], rows: list[str], policy: str) -> OneProcessDraws:
    """Hold a `OneProcessDraws` whenever a module of `model` runs (pushed at the outermost module's
    pre-hook, popped at its forward hook: the forward, and a checkpointed block's recompute in backward),
    and mark the column/row regions: a column-wise layer's forward hook opens one, a row-wise layer's
    pre-hook closes it."""
    mode = OneProcessDraws(policy)

    def enter(*_: Any) -> None:
        if mode.depth == 0:
            mode.__enter__()
        mode.depth += 1

    def leave(*_: Any) -> None:
        mode.depth -= 1
        if mode.depth == 0:
            mode.region = None
            mode.__exit__(None, None, None)

    for _, module in model.named_modules():
        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave, always_call=True)
    for name in columns:
        model.get_submodule(name).register_forward_hook(_opener(mode, name))
    for name in rows:
        model.get_submodule(name).register_forward_pre_hook(_closer(mode))
    return mode


def _opener(mode: OneProcessDraws, name: str) -> Callable[..., None]:
    def opened(*_: Any) -> None:
        mode.region = name

    return opened


def _closer(mode: OneProcessDraws) -> Callable[..., None]:
    def closed(*_: Any) -> None:
        mode.region = None

    return closed


def refuse_compiled_draws(model: nn.Module, policy: str) -> None:
    """Under `compile=` the draws cannot be one process's: torch.compile runs a compiled block eagerly
    whenever a TorchDispatchMode is active, so `OneProcessDraws` would switch compilation off silently,
    and without it a compiled dropout draws the same mask on every shard. A model with a dropout
    probability above 0 (an `nn.Dropout`, or a module attribute or config field named like a dropout) is
    refused unless `random="per-shard"` accepts torch's draws."""
    if policy != "one-process":
        return
    found = [name or type(model).__name__ for name, module in model.named_modules() if _drops(module)]
    if found:
        raise problem(
            f"compile= with tensor parallelism, and {found[0]!r} has a dropout probability above 0: "
            "ddpkit's one-process draws cannot run inside compiled code (torch.compile runs eagerly under "
            "the dispatch mode that draws them), so the masks would not be one process's",
            "Set the dropouts to 0 to compile, leave compile= out to keep one process's masks, or pass "
            'TPOptions(random="per-shard") to accept torch\'s draws (equal in distribution only)',
        )


def _drops(module: nn.Module) -> bool:
    if isinstance(module, nn.Dropout) and module.p > 0:
        return True
    config = getattr(module, "config", None)
    fields = {**vars(module), **(vars(config) if config is not None and hasattr(config, "__dict__") else {})}
    return any("dropout" in key and isinstance(value, float) and value > 0 for key, value in fields.items())
