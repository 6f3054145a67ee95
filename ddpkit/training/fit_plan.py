"""What `ddpkit.fit` was asked to do, checked once before the loop starts: the budget, evaluation, the
scheduler's interval and the reporting intervals (`FitPlan`); how many optimizer steps that makes (for the
progress bar); how many samples a micro-batch holds (for throughput).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ddpkit.errors import problem
from ddpkit.step import micro_batches
from ddpkit.training.callbacks import Callback
from ddpkit.training.evaluation import EvalStep

TrainStep = Callable[[nn.Module, Any], torch.Tensor]


@dataclass(frozen=True)
class FitPlan:
    """What `fit` was asked to do (validated by `check`)."""

    train_step: TrainStep
    epochs: int | None
    max_steps: int | None
    max_norm: float | None
    scheduler: Any
    scheduler_interval: str
    log_every: int
    track_every: int
    eval_loader: Iterable | None
    eval_step: EvalStep | None
    eval_every: int | None
    callbacks: tuple[Callback, ...]


def check(epochs, max_steps, eval_loader, eval_step, metrics, eval_every, interval, log_every) -> None:
    if epochs is None and max_steps is None:
        raise problem("fit needs a budget", "Pass epochs=N, max_steps=N, or both (whichever comes first)")
    for name, value in (("epochs", epochs), ("max_steps", max_steps), ("eval_every", eval_every)):
        if value is not None and value < 1:
            raise problem(f"{name}={value} is below 1", f"Pass {name}=1 or more, or leave it out")
    if log_every < 1:
        raise problem(f"log_every={log_every} is below 1", "Pass 1 or more")
    if (eval_loader is None) != (eval_step is None) or (eval_loader is not None and not metrics):
        raise problem(
            "evaluation needs eval_loader, eval_step and metrics together",
            "Pass all three (e.g. metrics={'accuracy': Accuracy()}), or none of them",
        )
    if interval not in ("step", "epoch"):
        raise problem(f"scheduler_interval={interval!r} is not 'step' or 'epoch'", "Pass one of those")


def total_steps(loader: Iterable, epochs: int | None, max_steps: int | None, k: int) -> int | None:
    try:
        per_epoch = len(loader)  # type: ignore[arg-type]
    except TypeError:
        return max_steps
    by_epochs = None if epochs is None else per_epoch * epochs // k
    known = [n for n in (by_epochs, max_steps) if n is not None]
    return min(known) if known else None


def batch_len(batch: object) -> int:
    """Samples in a micro-batch, for the throughput counters: `ddpkit.step.micro_batches.batch_len` (the first
    dimension of its first tensor, 0 when there is none), except that a lone 0-dim tensor is one sample."""
    if isinstance(batch, torch.Tensor) and not batch.dim():
        return 1
    return micro_batches.batch_len(batch)
