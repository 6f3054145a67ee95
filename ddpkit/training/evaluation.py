"""Evaluation with exact metrics: `evaluate(s, model, loader, eval_step, metrics)`, used by `fit`.

Evaluation runs on the strategy's evaluation module: DDP's inner module (its forward may broadcast
buffers, a collective, and evaluation shards may differ by one batch), or under FSDP the model itself,
whose forward all-gathers, so the ranks evaluate in lockstep.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ddpkit.errors import problem
from ddpkit.observe.metrics import Metric, MetricSet
from ddpkit.training.session import Session

EvalStep = Callable[[nn.Module, Any, MetricSet], None]


def evaluate(
    s: Session,
    model: nn.Module,
    loader: Iterable,
    eval_step: EvalStep,
    metrics: MetricSet | Mapping[str, Metric],
) -> dict[str, float]:
    """Run `eval_step(module, batch, metrics)` over `loader` without gradients; the synced metrics.

    Use a loader made with `s.loader(..., evaluation=True)` so every sample counts exactly once.
    """
    metric_set = metrics if isinstance(metrics, MetricSet) else MetricSet(s, **metrics)
    metric_set.reset()
    module = s.strategy.eval_module(model)
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad(), s.autocast():
            if s.strategy.collective_forward and s.distributed:
                _in_lockstep(s, module, loader, eval_step, metric_set)
            else:
                for batch in loader:
                    eval_step(module, batch, metric_set)
    finally:
        module.train(was_training)
    return metric_set.compute()


def _in_lockstep(
    s: Session, module: nn.Module, loader: Iterable, eval_step: EvalStep, metrics: MetricSet
) -> None:
    """Evaluate a model whose forward is a collective (FSDP): every rank runs as many forwards as the
    rank with the most batches; a rank out of batches repeats its last one into scratch metrics."""
    scratch = MetricSet(s, **{n: type(m)() for n, m in metrics.metrics.items()})
    batches, last = iter(loader), None
    while True:
        batch = next(batches, None)
        if s.all_ranks(batch is None):
            return
        if batch is not None:
            eval_step(module, batch, metrics)
            last = batch
        elif last is None:
            raise problem(
                f"rank {s.rank} has no evaluation batch while others do; under FSDP every rank must run "
                "the forward",
                "Use an evaluation set with at least one batch per rank",
            )
        else:
            eval_step(module, last, scratch)
