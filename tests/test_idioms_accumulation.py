"""Accumulation given as the whole job's (`Global`): resolved per rank once the world size is known, and
again at an elastic world size, so the optimizer sees the same global batch at 1, 2 and 4 ranks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ddpkit
from ddpkit.data.batching import Global, resolve_accumulation
from ddpkit.errors import DdpkitError
from ddpkit.names import ELASTIC_WORLD_ENV

pytestmark = pytest.mark.numerics  # compared with one process: the default-kernel leg runs it too

HW = ddpkit.Hardware(gpus=0, cpu_cores=2)
ROWS = 16


def _data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(3)
    return torch.utils.data.TensorDataset(
        torch.randn(ROWS, 3, generator=g, dtype=torch.float64),
        torch.randn(ROWS, 1, generator=g, dtype=torch.float64),
    )


def _one_epoch(given: str, env: dict | None = None) -> tuple[list[float], int, int, int]:
    """One epoch of 16 rows under `accumulation=Global(...)`: (weights, accumulation per rank, optimizer
    steps, rows this rank read per optimizer step)."""
    accumulation = Global(8) if given == "count" else Global(batch=ROWS, micro_batch=2)
    with ddpkit.session(
        accumulation=accumulation, verbose=False, **({"env": env, "hardware": HW} if env is not None else {})
    ) as s:
        torch.manual_seed(0)
        model = s.model(nn.Linear(3, 1).double())
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        loader = s.loader(_data(), batch_size=ROWS) if given == "count" else s.loader(_data())
        rows = 0
        for x, y in loader:
            with s.accumulate(model):
                s.backward(nn.functional.mse_loss(model(x), y))
            s.step(opt)
            rows += len(x)
        weights = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
        return weights, s.accumulation, s.stepper.steps, rows


def _full_batch_step() -> list[float]:
    torch.manual_seed(0)
    model = nn.Linear(3, 1).double()
    x, y = _data().tensors
    nn.functional.mse_loss(model(x), y).backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


@pytest.mark.parametrize("given", ["count", "batch"])
def test_the_optimizer_sees_the_same_global_batch_on_1_2_and_4_ranks(pool2, pool4, given: str) -> None:
    expected = _full_batch_step()
    runs = {1: [_one_epoch(given, env={})], 2: pool2.run(_one_epoch, given), 4: pool4.run(_one_epoch, given)}
    for world, results in runs.items():
        for weights, accumulation, steps, rows in results:
            assert accumulation == 8 // world, (world, accumulation)  # 8 micro-batches of 2 over all ranks
            assert steps == 1 and rows * world == ROWS, (world, steps, rows)  # one step of the 16 rows
            assert weights == pytest.approx(expected, rel=1e-12, abs=1e-12), world  # float64: sums reorder


def test_a_global_count_the_world_does_not_divide_is_refused_in_one_paragraph() -> None:
    with pytest.raises(DdpkitError) as err:
        resolve_accumulation(Global(6), 4, {})
    text = str(err.value)
    assert "accumulation=Global(6) does not divide by the world size 4" in text, text
    assert "(e.g. 4 or 8)" in text and "\n" not in text, text
    with pytest.raises(
        DdpkitError, match=r"Global\(batch=48, micro_batch=4\) does not divide by the world size 5"
    ):
        resolve_accumulation(Global(batch=48, micro_batch=4), 5, {})
    with pytest.raises(DdpkitError, match="not a whole number of micro-batches of 5"):
        Global(batch=48, micro_batch=5)
    with pytest.raises(DdpkitError, match="neither a count alone"):
        Global(4, batch=8, micro_batch=2)


def test_an_elastic_world_size_divides_the_global_count_again() -> None:
    env = {ELASTIC_WORLD_ENV: "4"}
    assert resolve_accumulation(Global(8), 4, env)[0] == 2
    per_rank, note = resolve_accumulation(
        Global(8), 2, env
    )  # fewer ranks: more steps each, same global batch
    assert per_rank == 4 and note is not None and "4 accumulation step(s) per rank at world size 2" in note
    assert resolve_accumulation(2, 2, env)[0] == 4  # a per-rank count: the elastic rule, as before


def test_a_loader_batch_other_than_the_sessions_global_batch_is_refused() -> None:
    with ddpkit.session(
        accumulation=Global(batch=16, micro_batch=2), env={}, hardware=HW, verbose=False
    ) as s:
        assert s.loader(_data()).batch.per_rank == 2  # the micro-batch, from the global batch
        with pytest.raises(DdpkitError, match=r"batch_size=32\) differs from the session's global batch 16"):
            s.loader(_data(), batch_size=32)
