"""What the checkpoint wing needs from a strategy and from the stepper, as protocols (no import of either).

    StateOwner       a strategy, as a save and a load see it: whose model it is, whole or sharded state
    OptimizerStates  which optimizers take sharded steps (their share is gathered at a save)

A module of its own, at the bottom of the wing, so that `dcp`, `portable` and `sync` all type the
strategy they are handed by one definition (`ddpkit.strategy.base.Strategy` is a `StateOwner`,
`ddpkit.step.stepping.Stepper` an `OptimizerStates`) without the checkpoint wing importing either.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn


class StateOwner(Protocol):
    """What a strategy says about a model's state (`ddpkit.strategy.base.Strategy` is one)."""

    @property
    def name(self) -> str: ...
    @property
    def shards_state(self) -> bool: ...  # read-only: a strategy's kind says it (a class variable)

    def owns(self, model: nn.Module) -> bool: ...
    def full_state(self, model: nn.Module) -> dict[str, torch.Tensor]: ...
    def load_full_state(
        self, model: nn.Module, state: Mapping[str, torch.Tensor], *, strict: bool
    ) -> None: ...
    def write_full_state(self, model: nn.Module, path: Path, rank: int) -> int: ...
    def check_loadable(self, saved: str, optimizers: Collection[str], path: Any) -> None: ...
    def sharded_state(self, model: nn.Module, optimizers: Mapping[str, torch.optim.Optimizer]) -> dict: ...
    def load_sharded_state(
        self, model: nn.Module, optimizers: Mapping[str, torch.optim.Optimizer], state: dict
    ) -> None: ...


class OptimizerStates(Protocol):
    """Which optimizers take sharded steps (`ddpkit.step.stepping.Stepper` is one): a save takes their
    share and gathers it (`ddpkit.checkpoint.gather`), a load keeps only this rank's share."""

    def sharded_step(self, optimizer: Any) -> Any: ...  # not None: `capture` takes its share
    def loaded_optimizer_state(self, optimizer: Any) -> None: ...
