"""The DDP contract on real gloo process groups: identical replicas, disjoint shards, rank-0 output."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.data import plan_batch
from ddpkit.errors import DdpkitError

pytestmark = pytest.mark.numerics  # .ci/run runs these again under ATEN_CPU_CAPABILITY=default


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 3))


def train_steps(steps: int) -> dict:
    """Train a few steps; return the parameters, and whether they moved away from the start."""
    with ddpkit.session(seed=1, verbose=False) as s:
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(96, 8, generator=g), torch.randint(0, 3, (96,), generator=g))
        model = s.model(_net())
        start = [p.detach().clone() for p in ddpkit.unwrap(model).parameters()]
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        loader = s.loader(data, batch_size=12 * s.world_size, shuffle=True)
        done = 0
        while done < steps:
            for x, y in loader:
                loss = nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                done += 1
                if done == steps:
                    break
        params = [p.detach().clone() for p in ddpkit.unwrap(model).parameters()]
        moved = any(not torch.equal(a, b) for a, b in zip(start, params, strict=True))
        return {"params": params, "moved": moved, "wrapped": type(model).__name__}


@pytest.mark.parametrize("world", [2, 3])
def test_replicas_stay_bitwise_identical(world: int, pool2, pool3) -> None:
    results = (pool2 if world == 2 else pool3).run(train_steps, 10)
    assert all(r["moved"] for r in results), "training did not change the weights"
    assert {r["wrapped"] for r in results} == {"DistributedDataParallel"}
    for other in results[1:]:
        for a, b in zip(results[0]["params"], other["params"], strict=True):
            assert torch.equal(a, b)
        # BatchNorm running statistics are not compared: DDP broadcasts rank 0's at the start of each
        # forward, then every rank updates them from its own shard, so they differ after a step.


def sample_indices(n: int, epochs: int, evaluation: bool) -> list[list[int]]:
    with ddpkit.session(seed=3, verbose=False) as s:
        data = TensorDataset(torch.arange(n))
        loader = s.loader(data, per_rank_batch_size=4, shuffle=not evaluation, evaluation=evaluation)
        return [[int(i) for (batch,) in loader for i in batch] for _ in range(epochs)]


@pytest.mark.parametrize("world", [2, 3])
def test_each_rank_sees_a_disjoint_shard_and_the_order_changes(world: int, pool2, pool3) -> None:
    per_rank = (pool2 if world == 2 else pool3).run(sample_indices, 60, 2, False)
    for epoch in range(2):
        shards = [set(r[epoch]) for r in per_rank]
        assert sum(len(s) for s in shards) == 60 and set().union(*shards) == set(range(60))
    assert [r[0] for r in per_rank] != [r[1] for r in per_rank], "set_epoch was not called: same order"


def test_uneven_training_data_is_padded_like_distributed_sampler(pool3) -> None:
    per_rank = pool3.run(sample_indices, 61, 1, False)
    everything = [i for r in per_rank for i in r[0]]
    assert len(everything) == 63 and set(everything) == set(range(61))  # 2 repeats so ranks stay in step


@pytest.mark.parametrize("n", [101, 1000])
def test_evaluation_shards_count_every_sample_once(n: int, pool3) -> None:
    per_rank = pool3.run(sample_indices, n, 1, True)
    everything = sorted(i for r in per_rank for i in r[0])
    assert everything == list(range(n))


def init_and_streams() -> dict:
    with ddpkit.session(seed=5, verbose=False) as s:
        before = nn.Linear(4, 4).weight.detach().clone()  # built before s.model: same seed everywhere
        s.model(nn.Linear(4, 4))
        return {"init": before, "after": torch.rand(3)}


def test_same_initial_weights_then_distinct_random_streams(pool2) -> None:
    r0, r1 = pool2.run(init_and_streams)
    assert torch.equal(r0["init"], r1["init"])
    assert not torch.equal(r0["after"], r1["after"]), "dropout/augmentation would repeat on every rank"


def output_and_collectives() -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), ddpkit.session(seed=0) as s:
        s.print("hello from the main rank")
        model = s.model(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)))
        s.barrier()
        total = s.all_reduce(float(s.rank + 1)).item()
        mean = s.all_reduce(torch.tensor([s.rank * 2.0]), op="mean").item()
        biggest = s.all_reduce(s.rank, op="max").item()
        return {
            "out": out.getvalue(),
            "main": s.is_main,
            "total": total,
            "mean": mean,
            "max": biggest,
            "ddp": isinstance(model, nn.parallel.DistributedDataParallel),
        }


def test_only_global_rank_zero_prints_and_collectives_agree(pool2) -> None:
    r0, r1 = pool2.run(output_and_collectives)
    assert "hello from the main rank" in r0["out"] and "mode ddp-cpu, world size 2" in r0["out"]
    assert r1["out"] == ""
    assert (r0["main"], r1["main"]) == (True, False)
    assert r0["total"] == r1["total"] == 3.0 and r0["mean"] == r1["mean"] == 1.0 and r0["max"] == 1
    assert r0["ddp"] and r1["ddp"]
    assert "BatchNorm computes statistics per rank" in r0["out"]


def test_single_process_needs_no_group_and_explains_ddp_options(capsys) -> None:
    with ddpkit.session(env={}, hardware=ddpkit.Hardware(gpus=0, cpu_cores=2)) as s:
        model = s.model(
            nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)), sync_batchnorm=True, static_graph=True
        )
        assert not torch.distributed.is_initialized()
        assert isinstance(model[1], nn.BatchNorm1d) and not isinstance(
            model, nn.parallel.DistributedDataParallel
        )
        assert s.all_reduce(2.5, op="mean").item() == 2.5
    out = capsys.readouterr().out
    assert "mode single-cpu" in out
    assert "BatchNorm already sees the whole batch" in out and "'static_graph': True" in out


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"batch_size": 30, "world_size": 4},
            r"global batch 30 is not divisible by world size 4 .* Use a multiple of 4 \(e.g. 32\)",
        ),
        (
            {"batch_size": 64, "world_size": 2, "accumulation": 3},
            r"x 3 accumulation step\(s\) = 6. Use a multiple of 6",
        ),
        ({"batch_size": None, "world_size": 2}, r"exactly one of batch_size"),
        ({"batch_size": 8, "per_rank_batch_size": 4, "world_size": 2}, r"exactly one of batch_size"),
    ],
)
def test_batch_arithmetic_errors(kwargs: dict, message: str) -> None:
    kwargs.setdefault("per_rank_batch_size", None)
    batch, per_rank = kwargs.pop("batch_size"), kwargs.pop("per_rank_batch_size")
    with pytest.raises(DdpkitError, match=message):
        plan_batch(batch, per_rank, **kwargs)


def test_batch_arithmetic_is_stated() -> None:
    plan = plan_batch(64, None, world_size=2, accumulation=2)
    assert (plan.per_rank, plan.global_size) == (16, 64)
    assert plan.describe() == "global batch 64 = 16 per rank x 2 rank(s) x 2 accumulation step(s)"


def tiny_dataset_loader() -> None:
    with ddpkit.session(verbose=False) as s:
        s.loader(TensorDataset(torch.arange(2)), batch_size=3)


def test_data_set_smaller_than_world_is_a_clear_error(pool3) -> None:
    with pytest.raises(AssertionError, match=r"2 sample\(s\), fewer than the world size 3"):
        pool3.run(tiny_dataset_loader)
