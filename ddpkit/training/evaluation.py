"""Evaluation with exact metrics: `evaluate(s, model, loader, eval_step, metrics)`, used by `fit`.

Evaluation runs on the strategy's evaluation module: DDP's inner module (its forward may broadcast
buffers, a collective, and evaluation shards may differ by one batch), or under FSDP the model itself,
whose forward all-gathers, so the ranks evaluate in lockstep.

Under tensor parallelism the ranks of one tensor group evaluate the same batch (the loader splits by
the data-parallel rank): only the group's first rank counts its updates, the others run the same
forwards into scratch metrics, so a sum (samples, tokens, a summed loss) counts each batch once. Under
loss parallel eval_step runs inside torch's `loss_parallel()` (`Strategy.loss_context`), so a cross
entropy on the sharded logits works there as in training (and `logits.full_tensor()` as anywhere).
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
    counted = metric_set if _counts(s) else _scratch(s, metric_set)  # a tensor group's batch once
    module = s.strategy.eval_module(model)
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad(), s.autocast(), s.strategy.loss_context(model):
            if s.strategy.collective_forward and s.distributed:
                _in_lockstep(s, module, loader, eval_step, counted)
            else:
                for batch in loader:
                    eval_step(module, batch, counted)
    finally:
        module.train(was_training)
    return metric_set.compute()


def _in_lockstep(
    s: Session, module: nn.Module, loader: Iterable, eval_step: EvalStep, metrics: MetricSet
) -> None:
    """Evaluate a model whose forward is a collective (FSDP): every rank runs as many forwards as the
    rank with the most batches; a rank out of batches repeats its last one into scratch metrics."""
    scratch = _scratch(s, metrics)
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


def _counts(s: Session) -> bool:
    """Whether this rank's evaluation updates count: not on the second and later ranks of a tensor group,
    which evaluate their group's batch again (their sums would count it `tensor` times)."""
    if not s.distributed:
        return True
    layout = s.layout
    return layout is None or layout.coordinate(s.rank, "tensor") == 0


def _scratch(s: Session, metrics: MetricSet) -> MetricSet:
    """Fresh metrics of the same kinds, updated and never computed (what a rank runs that does not count)."""
    return MetricSet(s, **{n: type(m)() for n, m in metrics.metrics.items()})
