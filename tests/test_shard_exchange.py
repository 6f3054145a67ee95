"""The reduce-scatter step (ddpkit.step.shard_exchange): the weights and norms of the all-reduce path bit
for bit at 2 ranks, clipping and token weighting on shards, active from the second step."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ddpkit
from ddpkit.parallel.shm_allreduce import ShmAllReduce

pytestmark = pytest.mark.numerics  # .ci/run runs these again under ATEN_CPU_CAPABILITY=default


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 3))


def train(exchange: str, steps: int = 5, accumulation: int = 1, tokens: bool = False) -> dict:
    """`steps` sharded AdamW steps with clipping; `exchange` "on" (the reduce-scatter) or "off"."""
    mode = "gradients" if exchange == "on" else True  # the reduce-scatter is asked for, never automatic
    with ddpkit.session(seed=0, verbose=False, shard_optimizer=mode, accumulation=accumulation) as s:
        model = s.model(_net())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        norms = []
        for step in range(steps * accumulation):
            g = torch.Generator().manual_seed(100 * step + s.rank)
            n = 8 + 3 * s.rank  # unequal per-rank batches: the token weighting matters
            x, y = torch.randn(n, 12, generator=g), torch.randint(0, 3, (n,), generator=g)
            with s.accumulate(model):
                out = model(x)
                if tokens:
                    s.backward(nn.functional.cross_entropy(out, y, reduction="sum"), tokens=n)
                else:
                    s.backward(nn.functional.cross_entropy(out, y))
            info = s.step(opt, max_norm=0.1)
            if info.stepped:
                norms.append(float(info.grad_norm))  # type: ignore[arg-type]
        sharder = s.stepper.sharded_step(opt)
        exchange_of = sharder.exchange if sharder is not None else None
        return {
            "params": [p.detach().clone() for p in model.parameters()],
            "norms": norms,
            "scattered_steps": exchange_of.steps if exchange_of is not None else 0,
        }


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("accumulation,tokens", [(1, False), (2, True)])
def test_reduce_scatter_step_gives_the_all_reduce_weights_bitwise(pool2, accumulation, tokens) -> None:
    on = pool2.run(train, "on", 5, accumulation, tokens)
    off = pool2.run(train, "off", 5, accumulation, tokens)
    # active: every step after the first (whose backward ran before the hook existed) reduce-scattered
    assert [r["scattered_steps"] for r in on] == [4, 4]
    assert [r["scattered_steps"] for r in off] == [0, 0]
    assert _same(on[0]["params"], on[1]["params"]), "replicas differ"
    assert _same(on[0]["params"], off[0]["params"]), "the reduce-scatter changed the weights"
    assert on[0]["norms"] == off[0]["norms"] == on[1]["norms"], "the sharded norm is not torch's"
    assert min(on[0]["norms"]) > 0.1, "clipping was not exercised"


def scatter_vs_all_reduce(seed: int) -> bool:
    """Random tensors of several sizes (across chunk boundaries): the reduce-scatter's owned tensors are
    bitwise the shm all-reduce's, the others untouched."""
    shm = ShmAllReduce(chunk_mb=0.004)  # 4 KiB chunks: tensors straddle them
    try:
        g = torch.Generator().manual_seed(seed + dist.get_rank())
        tensors = [torch.randn(n, generator=g) for n in (1, 700, 3000, 5, 2048, 1025)]
        owners = [i % dist.get_world_size() for i in range(len(tensors))]
        scattered = [t.clone() for t in tensors]
        shm.reduce_scatter_mean_(scattered, owners)
        reduced = [shm.all_reduce_mean_(t.clone()) for t in tensors]
        rank = dist.get_rank()
        return all(
            torch.equal(s, r if o == rank else t)
            for s, r, t, o in zip(scattered, reduced, tensors, owners, strict=True)
        )
    finally:
        shm.close()


def test_reduce_scatter_is_the_all_reduce_on_owned_tensors(pool2, pool3) -> None:
    assert pool2.run(scatter_vs_all_reduce, 1) == [True, True]
    assert pool3.run(scatter_vs_all_reduce, 2) == [True, True, True]


def fp16_overflow_in_one_share(exchange: str) -> dict:
    """fp16 scaler on CPU, sharded; at step 2 only rank 1's gradient of a tensor rank 1 owns is inf, so
    rank 0's share and its own gradients stay finite: the skip must still happen on every rank."""
    from ddpkit.parallel.precision import PrecisionPlan

    mode = "gradients" if exchange == "on" else True
    with ddpkit.session(
        seed=0, precision=PrecisionPlan("16", "cpu"), shard_optimizer=mode, verbose=False
    ) as s:
        model = s.model(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2)))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        owned_by_1 = ddpkit.unwrap(model)[2].weight  # 32 values: rank 1's (partition: 96 | 32+16+2)
        infos, params = [], []
        for step in range(4):
            g = torch.Generator().manual_seed(10 * step + s.rank)
            x, y = torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)
            with s.accumulate(model):
                loss = nn.functional.mse_loss(model(x).float(), y)
                if step == 2 and s.rank == 1:
                    loss = loss + owned_by_1.float().sum() * float("inf")
                s.backward(loss)
            infos.append(s.step(opt).skipped)
            params.append([p.detach().clone() for p in model.parameters()])
        sharder = s.stepper.sharded_step(opt)
        owner = sharder.owned[1] if sharder is not None else []
        return {
            "skipped": infos,
            "params": params[-1],
            "rank1_owns": any(p is owned_by_1 for p in owner),
            "scattered_steps": sharder.exchange.steps if sharder and sharder.exchange else 0,
        }


def test_fp16_overflow_seen_by_one_rank_skips_the_step_everywhere(pool2) -> None:
    on = pool2.run(fp16_overflow_in_one_share, "on")
    off = pool2.run(fp16_overflow_in_one_share, "off")
    assert on[0]["rank1_owns"] and [r["scattered_steps"] for r in on] == [3, 3]
    for r in (*on, *off):  # step 0 may skip too (the scaler's first scale): the same everywhere
        assert r["skipped"][1:] == [False, True, False] and r["skipped"] == off[0]["skipped"]
    assert _same(on[0]["params"], on[1]["params"]) and _same(on[0]["params"], off[0]["params"])
