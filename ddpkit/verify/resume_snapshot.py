"""One snapshot of a rank in `ddpkit verify --resume`: every value the uninterrupted and the resumed run
must agree on (weights, optimizer state and learning rates, the setup's objects, the stepper's loss
scale, RNG states, the samples of the global batch), flattened to `key -> tensor or plain value`.
Sharded strategies are snapshotted on their gathered state, keyed as an unsharded optimizer keys it, so
any two shapes compare value for value (`ddpkit.verify.resume_compare` compares them).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

import ddpkit
from ddpkit.verify.resume_compare import kind
from ddpkit.verify.run import digest, map_rows

if TYPE_CHECKING:
    from ddpkit.verify.resume import Resumable


def snapshot(
    s: ddpkit.Session, model: nn.Module, optimizer: Any, state: Resumable, step: int, trained: Any
) -> dict:
    """Every value the two runs must agree on, flattened to `key -> tensor or plain value`."""
    everything = {**state.saved, **state.others}
    out: dict[str, Any] = {
        "step": step,
        "_kinds": {n: kind(o) for n, o in everything.items()},
        "_saved": sorted(state.saved),
        "_strategy": s.strategy.describe(),
    }
    if trained is not None:
        batch, loss = trained
        rows = [digest(map_rows(batch, lambda t, i=i: t[i : i + 1])) for i in range(_rows(batch))]  # type: ignore[misc]
        everyone = s.gather_object(rows) if s.distributed else [rows]
        out["data.global_batch"] = hashlib.sha1(
            "".join(sorted(row for rank in everyone for row in rank)).encode()
        ).hexdigest()[:16]
        out["loss"] = float(s.all_reduce(loss.detach().float(), op="mean"))
    full = s.strategy.full_state(model) if s.strategy.shards_state else ddpkit.unwrap(model).state_dict()
    _flatten(out, "model", dict(full))
    _flatten(out, "optimizer", _optimizer_state(s, model, optimizer))
    _flatten(out, "stepper", s.stepper.state_dict())
    for name, obj in everything.items():
        if obj is model or obj is optimizer or obj is s.stepper:
            continue
        _flatten(out, name, _state_of(obj))
    out["rng.torch"] = torch.get_rng_state()
    out["rng.numpy"] = digest(torch.from_numpy(np.random.get_state()[1].astype(np.int64)))  # type: ignore[index]
    out["rng.python"] = hashlib.sha1(repr(random.getstate()).encode()).hexdigest()[:16]
    return out


def _optimizer_state(s: ddpkit.Session, model: nn.Module, optimizer: Any) -> Any:
    """The whole optimizer state, keyed by position as `optimizer.state_dict()` keys it: a sharded
    strategy's is gathered (torch's full optimizer state dict, keyed by parameter name, renamed by the
    order of the optimizer's parameters), so that any two shapes compare value for value."""
    if not s.strategy.shards_state:
        return s.stepper.optimizer_state(optimizer)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full: dict[str, Any] = dict(get_optimizer_state_dict(model, optimizer, options=options))  # whole: rank 0
    groups = full.get("param_groups", [])
    order = {name: i for i, name in enumerate(n for group in groups for n in group["params"])}
    return {
        "state": {order[name]: value for name, value in full.get("state", {}).items()},
        "param_groups": [{**group, "params": [order[n] for n in group["params"]]} for group in groups],
    }


def _rows(batch: Any) -> int:
    found: list[int] = []

    def note(t: torch.Tensor) -> torch.Tensor:
        found.append(t.shape[0])
        return t

    map_rows(batch, note)
    return found[0] if found else 0


def _state_of(obj: Any) -> Any:
    if isinstance(obj, torch.Generator):
        return obj.get_state()
    if hasattr(obj, "state_dict"):
        return obj.state_dict()
    return obj


def _flatten(out: dict[str, Any], prefix: str, value: Any) -> None:
    if isinstance(value, Mapping):
        for key, item in value.items():
            _flatten(out, f"{prefix}.{key}", item)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _flatten(out, f"{prefix}.{i}", item)
    elif isinstance(value, torch.Tensor):
        out[prefix] = value.detach().clone().cpu()
    elif value is None or isinstance(value, (bool, int, float, str)):
        out[prefix] = value
    # functions (a LambdaLR's lambdas are not in its state_dict anyway) and other objects: not compared
