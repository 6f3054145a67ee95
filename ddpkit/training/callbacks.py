"""What `ddpkit.fit`'s callbacks see and what it returns: `FitState`, `Callback`, `FitResult`.

A callback runs on every rank; `state.request_stop(reason)` ends the run after the current step on every
rank (the loop agrees on it in its one all-reduce per step, `ddpkit.training.fit`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ddpkit.training.session import Session


@dataclass
class FitState:
    """What callbacks see. `request_stop(reason)` ends the run after the current step, on every rank."""

    s: Session
    model: nn.Module
    optimizer: torch.optim.Optimizer
    epoch: int = 0
    step: int = 0  # optimizer steps done in this fit call
    loss: float = math.nan  # the last step's loss, mean over ranks and micro-batches
    epoch_losses: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)  # every counted step's loss
    metrics: dict[str, float] = field(default_factory=dict)  # the last evaluation
    evals: list[dict[str, float]] = field(default_factory=list)  # every evaluation, with its "step"
    stop_reason: str | None = None  # set by request_stop on this rank, or when another rank asked
    stopping: bool = False  # all ranks agreed to stop (in a collective): the loop ends after this step

    def request_stop(self, reason: str = "requested by a callback") -> None:
        self.stop_reason = reason

    def _agree_stop(self) -> None:
        self.stopping = True
        self.stop_reason = self.stop_reason or "requested by a callback on another rank"


class Callback:
    """Override any of these; each gets the `FitState`. They run on every rank."""

    def on_fit_start(self, state: FitState) -> None: ...
    def on_fit_end(self, state: FitState) -> None: ...
    def on_epoch_start(self, state: FitState) -> None: ...
    def on_epoch_end(self, state: FitState) -> None: ...
    def on_step_start(self, state: FitState) -> None: ...
    def on_step_end(self, state: FitState) -> None: ...
    def on_eval_start(self, state: FitState) -> None: ...
    def on_eval_end(self, state: FitState) -> None: ...


@dataclass(frozen=True)
class FitResult:
    steps: int
    epochs: int  # epochs started
    losses: list[float]  # per counted optimizer step, mean over ranks
    evals: list[dict[str, float]]
    seconds: float
    stop_reason: str | None
    skipped_steps: int  # steps that applied no update: the fp16 scaler's (inf/nan) and the spike guard's
    anatomy: dict[str, Any] = field(default_factory=dict)  # StepMonitor.summary(): ranks, findings, MFU
