"""Uneven inputs on gloo: 61 samples (not divisible by 2 or 3) split unevenly over the ranks. With the
user's own iterables, `s.join(model)` (torch's Join) keeps ranks with fewer batches from hanging, and each
step averages the ranks that still had data; ddpkit's loader pads instead, so every rank has as many
batches."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

pytestmark = pytest.mark.numerics  # .ci/run runs these again under ATEN_CPU_CAPABILITY=default

SIZES = {2: [40, 21], 3: [31, 17, 13]}  # 61 samples; batches of 4: [10, 6] and [8, 5, 4] per rank


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))


def _samples() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return torch.randn(61, 6, generator=g), torch.randn(61, 2, generator=g)


def _rank_batches(world: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    x, y = _samples()
    out, start = [], 0
    for n in SIZES[world]:
        xs, ys = x[start : start + n], y[start : start + n]
        out.append([(xs[i : i + 4], ys[i : i + 4]) for i in range(0, n, 4)])
        start += n
    return out


def _reference(net: nn.Module, per_rank: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> list[torch.Tensor]:
    """One process: step t averages the gradients of the ranks that still have a batch t."""
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for t in range(max(len(b) for b in per_rank)):
        active = [b[t] for b in per_rank if t < len(b)]
        opt.zero_grad()
        for x, y in active:
            (nn.functional.mse_loss(net(x), y) / len(active)).backward()
        opt.step()
    return [p.detach().clone() for p in net.parameters()]


def train_joined() -> dict:
    with ddpkit.session(seed=0, verbose=False) as s:
        net = _net()
        reference = _reference(copy.deepcopy(net), _rank_batches(s.world_size))
        model = s.model(net)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        steps = 0
        with s.join(model):
            for x, y in _rank_batches(s.world_size)[s.rank]:
                with s.accumulate(model):
                    s.backward(nn.functional.mse_loss(model(x), y))
                steps += s.step(opt).stepped
        params = [p.detach().clone() for p in ddpkit.unwrap(model).parameters()]
        return {"params": params, "reference": reference, "steps": steps}


@pytest.mark.parametrize("world", [2, 3])
def test_join_neither_hangs_nor_skews(world: int, pool2, pool3) -> None:
    results = (pool2 if world == 2 else pool3).run(train_joined, timeout=60)
    assert [r["steps"] for r in results] == [len(b) for b in _rank_batches(world)]
    for r in results:
        assert all(torch.equal(a, b) for a, b in zip(results[0]["params"], r["params"], strict=True))
        diff = max((a - b).abs().max().item() for a, b in zip(r["params"], r["reference"], strict=True))
        assert diff < 1e-5, f"joined training differs from the active-rank average by {diff:.2e}"


def train_with_loader() -> dict:
    with ddpkit.session(seed=0, verbose=False) as s:
        model = s.model(_net())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = s.loader(TensorDataset(*_samples()), per_rank_batch_size=4, shuffle=True)
        batches = 0
        for _ in range(2):
            for x, y in loader:
                with s.accumulate(model):
                    s.backward(nn.functional.mse_loss(model(x), y))
                s.step(opt)
                batches += 1
        return {"batches": batches, "params": [p.detach().clone() for p in ddpkit.unwrap(model).parameters()]}


def test_ddpkit_loader_gives_every_rank_the_same_number_of_batches(pool3) -> None:
    results = pool3.run(train_with_loader, timeout=60)
    assert {r["batches"] for r in results} == {2 * 6}  # ceil(61 / 3) = 21 samples per rank: 6 batches
    for r in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0]["params"], r["params"], strict=True))
