"""SyncBatchNorm on CPU/gloo: per-rank BatchNorm breaks the DDP = one-process equivalence with small
per-rank batches; ddpkit's SyncBatchNorm restores it (outputs, gradients, running statistics)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ddpkit
from ddpkit.parallel.syncbn import SyncBatchNorm, convert_batchnorm, convert_sync_batchnorm

pytestmark = pytest.mark.numerics  # .ci/run runs these again under ATEN_CPU_CAPABILITY=default


def _global_batch(n: int = 12, c: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randn(n, c, 4, 4, generator=g) * 3 + 50  # far from zero: a naive E[x^2]-E[x]^2 would suffer


def sync_layer(sizes: list[int]) -> dict:
    """Rank r normalises rows of the global batch (sizes[r] of them, possibly 0) with SyncBatchNorm."""
    with ddpkit.session(verbose=False) as s:
        x_all = _global_batch(sum(sizes))
        start = sum(sizes[: s.rank])
        x = x_all[start : start + sizes[s.rank]].clone().requires_grad_(True)
        torch.manual_seed(0)
        bn = SyncBatchNorm(3, momentum=None)
        with torch.no_grad():
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-1, 1)
        weights = torch.linspace(-1, 1, x_all.numel()).view_as(x_all)[start : start + sizes[s.rank]]
        for _ in range(2):  # two forwards: cumulative running averages
            y = bn(x)
        (y * weights).sum().backward()
        grads = torch.stack([bn.weight.grad, bn.bias.grad])
        return {
            "y": y.detach(),
            "x_grad": x.grad,
            "param_grads": s.all_reduce(grads),
            "running": (bn.running_mean.clone(), bn.running_var.clone()),
        }


def test_sync_batchnorm_equals_batchnorm_on_the_concatenated_batch(pool3) -> None:
    sizes = [5, 7, 0]  # uneven, and one rank without samples
    results = pool3.run(sync_layer, sizes)
    x_all = _global_batch(sum(sizes)).requires_grad_(True)
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(3, momentum=None)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-1, 1)
    for _ in range(2):
        y = bn(x_all)
    (y * torch.linspace(-1, 1, x_all.numel()).view_as(x_all)).sum().backward()
    assert torch.allclose(torch.cat([r["y"] for r in results]), y.detach(), atol=1e-5)
    assert torch.allclose(torch.cat([r["x_grad"] for r in results]), x_all.grad, atol=1e-5)
    expected = torch.stack([bn.weight.grad, bn.bias.grad])
    for r in results:
        assert torch.allclose(r["param_grads"], expected, rtol=1e-4, atol=1e-4)
        assert torch.allclose(r["running"][0], bn.running_mean, rtol=1e-6)
        assert torch.allclose(r["running"][1], bn.running_var, rtol=1e-4)  # unbiased over all 12 samples


def _bn_net() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))


def _batches(steps: int, global_batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randn(global_batch, 6, generator=g), torch.randn(global_batch, 2, generator=g))
        for _ in range(steps)
    ]


def _train(model: nn.Module, batches: list, opt: torch.optim.Optimizer) -> None:
    for x, y in batches:
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


def bn_gap(sync: bool) -> dict:
    """DDP with 4 samples per rank vs one process on the global batch: the largest weight difference."""
    with ddpkit.session(seed=0, verbose=False) as s:
        net = _bn_net()
        reference = copy.deepcopy(net)  # the same initial weights as the DDP replica
        model = s.model(net, sync_batchnorm=sync)
        batches = _batches(5, 4 * s.world_size)
        shard = [(x[4 * s.rank : 4 * s.rank + 4], y[4 * s.rank : 4 * s.rank + 4]) for x, y in batches]
        _train(model, shard, torch.optim.SGD(model.parameters(), lr=0.1))
        _train(reference, batches, torch.optim.SGD(reference.parameters(), lr=0.1))
        mine, ref = ddpkit.unwrap(model), reference
        gap = max(
            (a - b).abs().max().item() for a, b in zip(mine.parameters(), ref.parameters(), strict=True)
        )
        stats = max((mine[1].running_var - ref[1].running_var).abs().max().item(), 0.0)
        return {"gap": gap, "stats_gap": stats, "layer": type(mine[1]).__name__}


def test_sync_batchnorm_restores_equivalence_with_one_process(pool2) -> None:
    per_rank = pool2.run(bn_gap, False)[0]
    synced = pool2.run(bn_gap, True)[0]
    assert per_rank["layer"] == "BatchNorm1d" and synced["layer"] == "SyncBatchNorm"
    assert per_rank["gap"] > 1e-3, "per-rank statistics should break the equivalence"
    assert synced["gap"] < 1e-5 and synced["stats_gap"] < 1e-5
    print(f"BatchNorm gap {per_rank['gap']:.2e} -> SyncBatchNorm gap {synced['gap']:.2e}")


def test_torch_syncbatchnorm_on_cuda_ddpkit_s_elsewhere() -> None:
    assert isinstance(convert_batchnorm(_bn_net(), "cuda")[1], nn.SyncBatchNorm)
    assert isinstance(convert_batchnorm(_bn_net(), "cpu")[1], SyncBatchNorm)


def test_conversion_shares_parameters_and_acts_as_batchnorm_without_a_group() -> None:
    net = _bn_net()
    bn = net[1]
    layer = convert_sync_batchnorm(net)[1]
    assert isinstance(layer, SyncBatchNorm) and not isinstance(layer, nn.SyncBatchNorm)  # so DDP accepts it
    assert layer.weight is bn.weight and layer.running_var is bn.running_var
    root, plain = convert_sync_batchnorm(nn.BatchNorm1d(16)), nn.BatchNorm1d(16)  # the root is replaced too
    h = torch.randn(8, 16)
    assert torch.allclose(root(h), plain(h), atol=1e-6)  # no process group: plain BatchNorm
    assert torch.allclose(root.running_var, plain.running_var)
    root.eval(), plain.eval()
    assert torch.allclose(root(h), plain(h), atol=1e-6)
