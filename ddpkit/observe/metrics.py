"""Exact distributed evaluation: reductions, gathers, metric accumulators and stop flags.

    metrics = MetricSet(s, loss=Mean(), accuracy=Accuracy())
    with torch.no_grad():
        for x, y in s.loader(test_set, batch_size=512, evaluation=True):   # every sample once
            out = model(x)
            metrics["loss"].update(F.cross_entropy(out, y, reduction="none"))  # per-sample values
            metrics["accuracy"].update(out, y)
    result = metrics.compute()      # {"loss": ..., "accuracy": ...}, the same on every rank

Why it is exact: each metric keeps float64 sums weighted by sample counts (never a mean of per-rank
means, which is wrong when shards differ in size), and `compute` adds them over ranks in one
all-reduce. Integer counts (accuracy) are exact in float64 up to 2**53; sums of losses differ from one
process only by the order of float64 additions. Before the all-reduce, the ranks compare the names and
kinds of their metrics; a mismatch is an error on every rank rather than a silent mix-up or a hang.

`compute` is a collective: call it on every rank, the same number of times. The reductions, gathers
and stop flags it builds on live in `ddpkit.parallel.collectives`. A DTensor update (a loss computed on
logits sharded over the vocabulary, under tensor parallelism's loss parallel) counts as its whole value.
"""

from __future__ import annotations

import sys
import zlib

import torch

from ddpkit.errors import problem
from ddpkit.parallel.collectives import Ranks, all_reduce, gather_object


def _whole(value: float | torch.Tensor) -> torch.Tensor:
    """A value as a plain tensor: a DTensor becomes its whole value (torch refuses to add a DTensor to the
    plain float64 sums; a replicated one, as loss parallel's loss is, needs no collective)."""
    tensor = torch.as_tensor(value)
    # torch.distributed.tensor not loaded: no DTensor can exist (and its import is not paid here)
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and isinstance(tensor, dtensor.DTensor):
        tensor = tensor.full_tensor()
    return tensor.detach()


# -- metric accumulators -----------------------------------------------------------------------------
class Metric:
    """A metric as float64 sums that add over ranks; `value` turns the global sums into the metric."""

    size = 1

    def __init__(self) -> None:
        self.state = torch.zeros(self.size, dtype=torch.float64)

    def reset(self) -> None:
        self.state.zero_()

    def value(self, totals: torch.Tensor) -> float:
        raise NotImplementedError

    def _add(self, *values: float | torch.Tensor) -> None:
        parts = [_whole(v) for v in values]
        device = next((p.device for p in parts if p.device.type != "cpu"), self.state.device)
        if self.state.device != device:  # stay on the GPU: no host sync per batch
            self.state = self.state.to(device)
        self.state += torch.stack([p.to(device, torch.float64) for p in parts])


class Mean(Metric):
    """Mean over samples: `update(per_sample_values)`, or `update(batch_mean, weight=batch_size)`."""

    size = 2

    def update(self, value: float | torch.Tensor, weight: float | None = None) -> None:
        v = _whole(value)
        if weight is None:
            self._add(v.double().sum(), v.numel())
        else:
            self._add(v.double().sum() * weight, weight)

    def value(self, totals: torch.Tensor) -> float:
        return (totals[0] / totals[1]).item() if totals[1] > 0 else float("nan")


class Sum(Metric):
    """A plain sum over every rank's updates."""

    def update(self, value: float | torch.Tensor) -> None:
        self._add(_whole(value).double().sum())

    def value(self, totals: torch.Tensor) -> float:
        return totals[0].item()


class Accuracy(Metric):
    """Fraction of correct predictions: `update(logits (N, C) or labels (N,), targets (N,))`."""

    size = 2

    def update(self, predictions: torch.Tensor, targets: torch.Tensor) -> None:
        predictions, targets = _whole(predictions), _whole(targets)
        if predictions.dim() == targets.dim() + 1:
            predictions = predictions.argmax(-1)
        if predictions.shape != targets.shape:
            raise problem(
                f"Accuracy got predictions of shape {tuple(predictions.shape)} for targets of shape "
                f"{tuple(targets.shape)}",
                "Pass logits (N, C) or labels (N,) with targets (N,)",
            )
        self._add((predictions == targets).sum(), targets.numel())

    def value(self, totals: torch.Tensor) -> float:
        return (totals[0] / totals[1]).item() if totals[1] > 0 else float("nan")


class MetricSet:
    """Named metrics that sync together when computed: one name check, one all-reduce."""

    def __init__(self, s: Ranks, **metrics: Metric) -> None:
        self.s = s
        self.metrics = dict(sorted(metrics.items()))

    def __getitem__(self, name: str) -> Metric:
        return self.metrics[name]

    def reset(self) -> None:
        for metric in self.metrics.values():
            metric.reset()

    def compute(self) -> dict[str, float]:
        """The global value of every metric, identical on every rank (a collective)."""
        signature = [(name, type(m).__name__, m.size) for name, m in self.metrics.items()]
        if self.s.distributed:
            self._check_same_metrics(signature)
        states = [m.state.to(self.s.device) for m in self.metrics.values()]  # un-updated ones: on the CPU
        packed = torch.cat(states) if states else torch.zeros(0, dtype=torch.float64, device=self.s.device)
        totals = all_reduce(self.s, packed).cpu()
        out, offset = {}, 0
        for name, metric in self.metrics.items():
            out[name] = metric.value(totals[offset : offset + metric.size])
            offset += metric.size
        return out

    def _check_same_metrics(self, signature: list[tuple[str, str, int]]) -> None:
        digest = zlib.crc32(repr(signature).encode())
        mine = torch.tensor([digest, -digest], dtype=torch.int64, device=self.s.device)
        if torch.equal(all_reduce(self.s, mine, op="max"), mine.new_tensor([digest, -digest])):
            return  # max of digests and of their negatives agree: all ranks have this signature
        every = gather_object(self.s, signature)  # every rank sees the mismatch, so all reach this call
        described = "; ".join(f"rank {r}: {[f'{n} ({k})' for n, k, _ in sig]}" for r, sig in enumerate(every))
        raise problem(
            f"ranks report different metrics ({described})",
            "Build the same metrics, under the same names, on every rank; a rank without samples keeps "
            "its metrics at zero rather than leaving them out",
        )


def compute(s: Ranks, **metrics: Metric) -> dict[str, float]:
    """Sync and compute metrics in one go: `compute(s, loss=mean_loss, accuracy=acc)`."""
    return MetricSet(s, **metrics).compute()
