"""Exact distributed evaluation on gloo: 101 and 1000 samples at world 2 and 3 give the one-process
metric; gathers of uneven tensors and objects; mismatched metric names and stop flags.

What is exact by construction is the bookkeeping: every sample counted once, none padded in. The float
values a model computes for a batch of 16 and for a batch of 1000 take different kernel paths, which
differ in the last bits on some CPUs (ATEN_CPU_CAPABILITY=default, AVX2, AVX-512), so those are compared
within float32 rounding, never bitwise."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.errors import DdpkitError
from ddpkit.observe.metrics import Accuracy, Mean, MetricSet, Sum
from ddpkit.parallel.collectives import gather, gather_object, reduce_mean, reduce_sum

pytestmark = pytest.mark.numerics  # .ci/run runs these again under ATEN_CPU_CAPABILITY=default


def _problem(n: int) -> tuple[nn.Module, TensorDataset]:
    g = torch.Generator().manual_seed(n)
    x, y = torch.randn(n, 5, generator=g), torch.randint(0, 4, (n,), generator=g)
    torch.manual_seed(1)
    return nn.Linear(5, 4), TensorDataset(x, y)


def _update(metrics: MetricSet, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    out = model(x)
    metrics["loss"].update(nn.functional.cross_entropy(out, y, reduction="none"))
    metrics["batch_mean_loss"].update(nn.functional.cross_entropy(out, y), weight=len(y))
    metrics["accuracy"].update(out, y)
    metrics["samples"].update(len(y))
    metrics["label_mean"].update(y.double())  # integers: exact in float64 whatever the sharding


def _metric_set(s: ddpkit.Session) -> MetricSet:
    return MetricSet(
        s, loss=Mean(), batch_mean_loss=Mean(), accuracy=Accuracy(), samples=Sum(), label_mean=Mean()
    )


def evaluate(n: int) -> dict:
    with ddpkit.session(verbose=False) as s:
        model, data = _problem(n)
        metrics = _metric_set(s)
        with torch.no_grad():
            for x, y in s.loader(data, batch_size=16 * s.world_size, evaluation=True):
                _update(metrics, model, x, y)
        return metrics.compute()


def one_process(n: int) -> dict:
    with ddpkit.session(verbose=False, env={}, hardware=ddpkit.Hardware(0, 2)) as s:
        model, data = _problem(n)
        metrics = _metric_set(s)
        with torch.no_grad():
            x, y = data.tensors
            _update(metrics, model, x, y)
        return metrics.compute()


@pytest.mark.parametrize("n", [101, 1000])
@pytest.mark.parametrize("world", [2, 3])
def test_evaluation_equals_one_process(n: int, world: int, pool2, pool3) -> None:
    results = (pool2 if world == 2 else pool3).run(evaluate, n)
    want = one_process(n)
    assert all(r == results[0] for r in results), "ranks disagree"  # one all-reduce: same bits everywhere
    got = results[0]
    # the bookkeeping is exact: every sample counted once, padding excluded
    assert got["samples"] == n and got["label_mean"] == want["label_mean"]
    # a prediction may flip only on a near-tie between logits that differ in the last bits
    assert abs(got["accuracy"] - want["accuracy"]) <= 1 / n
    # per-sample float32 losses from batches of 16 vs one batch of n: a few float32 ulps apart
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
    # batch means weighted by their sample counts: the float32 rounding of each batch mean remains
    assert got["batch_mean_loss"] == pytest.approx(want["loss"], rel=1e-6)


def collectives() -> dict:
    with ddpkit.session(verbose=False) as s:
        r = s.rank
        rows = torch.arange(3 * (r + 1), dtype=torch.float32).view(r + 1, 3) + 100 * r  # r+1 rows
        return {
            "gather": gather(s, rows),
            "bools": gather(s, torch.tensor([True, r == 1])),
            "empty": gather(s, torch.zeros(0 if r == 0 else 2, 2)).shape,
            "objects": gather_object(s, {"rank": r, "name": f"r{r}"}),
            "sum": reduce_sum(s, r + 1).item(),
            "weighted": reduce_mean(s, torch.tensor(float(r)), weight=10 if r == 0 else 30).item(),
            "any": s.any_rank(r == 1),
            "all": s.all_ranks(r == 1),
            "all_true": s.all_ranks(True),
        }


def test_gathers_reductions_and_stop_flags(pool2) -> None:
    r0, r1 = pool2.run(collectives)
    expected = torch.cat([torch.arange(3.0).view(1, 3), torch.arange(6.0).view(2, 3) + 100])
    for r in (r0, r1):
        assert torch.equal(r["gather"], expected)
        assert r["bools"].tolist() == [True, False, True, True]
        assert r["empty"] == (2, 2)
        assert r["objects"] == [{"rank": 0, "name": "r0"}, {"rank": 1, "name": "r1"}]
        assert r["sum"] == 3 and r["weighted"] == pytest.approx(0.75)
        assert (r["any"], r["all"], r["all_true"]) == (True, False, True)


def mismatched_names() -> str:
    with ddpkit.session(verbose=False) as s:
        metrics = MetricSet(
            s, loss=Mean(), **({"accuracy": Accuracy()} if s.rank == 0 else {"acc": Accuracy()})
        )
        try:
            metrics.compute()
        except DdpkitError as exc:
            return str(exc)
        return "computed"


def mismatched_gather() -> str:
    with ddpkit.session(verbose=False) as s:
        try:
            gather(s, torch.zeros(2, 3 + s.rank))
        except DdpkitError as exc:
            return str(exc)
        return "gathered"


def test_ranks_with_different_metric_names_all_refuse(pool2) -> None:
    r0, r1 = pool2.run(mismatched_names, timeout=30)
    assert r0 == r1 and r0.startswith("ranks report different metrics (rank 0: ['accuracy (Accuracy)'")
    assert "rank 1: ['acc (Accuracy)', 'loss (Mean)']" in r0 and "under the same names" in r0
    g0, g1 = pool2.run(mismatched_gather, timeout=30)
    assert g0 == g1 and "same dtype and trailing dimensions" in g0 and "shape (2, 4)" in g0


def test_empty_metrics_and_bad_shapes() -> None:
    with ddpkit.session(verbose=False, env={}, hardware=ddpkit.Hardware(0, 2)) as s:
        assert math.isnan(MetricSet(s, accuracy=Accuracy()).compute()["accuracy"])  # no samples: NaN, not 0
        with pytest.raises(DdpkitError, match=r"predictions of shape \(3,\) for targets of shape \(4,\)"):
            Accuracy().update(torch.zeros(3), torch.zeros(4))


def dtensor_updates() -> dict[str, float]:
    """A loss parallel's values reach the metrics as DTensors: replicated (the loss) or sharded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    with ddpkit.session(verbose=False) as s:
        mesh = init_device_mesh("cpu", (s.world_size,))
        per_sample = torch.arange(6.0)  # the same values on both ranks, as a tensor group holds them
        replicated = DTensor.from_local(per_sample, mesh, [Replicate()])
        sharded = DTensor.from_local(per_sample.chunk(2)[s.rank], mesh, [Shard(0)])
        logits = DTensor.from_local(torch.eye(4)[[0, 1, 2, 3]], mesh, [Replicate()])
        metrics = MetricSet(s, replicated=Mean(), sharded=Sum(), weighted=Mean(), accuracy=Accuracy())
        metrics["replicated"].update(replicated)
        metrics["sharded"].update(sharded)
        metrics["weighted"].update(replicated.mean(), weight=6)
        metrics["accuracy"].update(logits, torch.tensor([0, 1, 2, 0]))
        return metrics.compute()


def test_dtensor_values_count_as_their_whole_value(pool2) -> None:
    r0, r1 = pool2.run(dtensor_updates, timeout=60)
    assert r0 == r1
    assert r0["replicated"] == pytest.approx(2.5) and r0["weighted"] == pytest.approx(2.5)
    assert r0["sharded"] == pytest.approx(2 * 15.0)  # each rank's update is the whole 0..5; two ranks add
    assert r0["accuracy"] == pytest.approx(0.75)
