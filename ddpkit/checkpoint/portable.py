"""A sharded (FSDP) checkpoint loaded by a strategy that keeps whole state: DDP, or one process.

    taken = portable.take(ctx.strategy, parts, manifest["objects"])   # before the whole-file loading
    portable.load_whole(found, taken, strict=strict)                  # model and optimizers, whole

An FSDP save keeps its model and that model's optimizers in DCP shards (`ddpkit.checkpoint.dcp`), not in
`model.safetensors`; a run that resumes it under DDP, or as one process (where `strategy="fsdp"`
becomes the plain module), holds the model whole. DCP itself reads any saved sharding into any
target: the target here is the whole model's state dict and each optimizer's, keyed by parameter name
(`torch.distributed.checkpoint.state_dict`, which builds an optimizer's state when it has none yet),
filled by DCP's load (on every rank: a collective over the default group when there is one, none in
one process), then set into the model and the optimizers. Values are copied, so the loaded state is
the saved state bitwise.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ddpkit.checkpoint import dcp as checkpoint_dcp
from ddpkit.checkpoint.files import Found
from ddpkit.checkpoint.owners import StateOwner
from ddpkit.parallel.modules import unwrap


@dataclass(frozen=True)
class Taken:
    """The model (under its saved name) and the optimizers a sharded checkpoint holds for it."""

    name: str
    model: nn.Module
    optimizers: Mapping[str, torch.optim.Optimizer]
    strategy: StateOwner  # sets the weights (`load_full_state`: a PEFT checkpoint has no frozen base)


def take(
    strategy: StateOwner, parts: dict[str, dict[str, Any]], saved: Mapping[str, list[str]]
) -> Taken | None:
    """When the checkpoint holds sharded state and this strategy keeps whole state: take the model and
    optimizers it saved through DCP out of `parts` (they are loaded by `load_whole`). None otherwise."""
    names = saved.get("sharded", [])
    if strategy.shards_state or not names:
        return None
    model_name = next((n for n in names if n in parts["modules"]), None)
    if model_name is None:
        return None
    model = parts["modules"].pop(model_name)
    optimizers = {n: parts["shared"].pop(n) for n in names if n in parts["shared"]}
    return Taken(model_name, model, optimizers, strategy)


def load_whole(found: Found, taken: Taken, *, strict: bool) -> None:
    """Read the DCP shards into the whole model and its optimizers (every rank). The model's tensors the
    checkpoint holds are read (a PEFT model's: its trainable ones only, the frozen base having come
    from the pretrained weights at `s.model`), then set by the strategy's `load_full_state`, which
    refuses a checkpoint lacking one it needs (`strict`)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    model = unwrap(taken.model)
    options = StateDictOptions(strict=strict)
    held = checkpoint_dcp.saved_keys(found.path)
    whole = get_model_state_dict(model, options=options)
    state: dict[str, Any] = {taken.name: {k: v for k, v in whole.items() if f"{taken.name}.{k}" in held}}
    for name, opt in taken.optimizers.items():
        state[name] = get_optimizer_state_dict(model, opt, options=options)
    with warnings.catch_warnings():  # one process: DCP says it loads without a process group, as meant
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        checkpoint_dcp.load(state, found.path)  # refuses a planted pickle in the metadata, then DCP's load
    taken.strategy.load_full_state(taken.model, state.pop(taken.name), strict=strict)
    for name, opt in taken.optimizers.items():
        set_optimizer_state_dict(model, opt, state[name], options=options)
