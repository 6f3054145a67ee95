"""Gradient accumulation and clipping on real gloo groups: one all-reduce per bucket per optimizer step
(counted with a communication hook), k micro-batches of b equal one batch of k*b, a clipped norm that is
the same on every rank, and the misuses that must fail loudly."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.errors import DdpkitError

pytestmark = pytest.mark.numerics  # .ci/run runs these again under ATEN_CPU_CAPABILITY=default


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(10, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3))


def _dataset(n: int = 256) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 10, generator=g), torch.randint(0, 3, (n,), generator=g))


def count_all_reduces(k: int, steps: int) -> dict:
    with ddpkit.session(seed=0, accumulation=k, verbose=False) as s:
        model = s.model(_mlp(), bucket_cap_mb=0.01)  # ~10 KB buckets: several per backward
        calls: list[tuple[int, int]] = []  # (micro-batch number, bucket index)
        micro = [0]

        def counting_hook(state, bucket):  # no annotations: DDP compares them to real types
            calls.append((micro[0], bucket.index()))
            return default_hooks.allreduce_hook(state, bucket)

        model.register_comm_hook(None, counting_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        stepped = []
        for x, y in s.loader(_dataset(), batch_size=8 * s.world_size * k, shuffle=True):
            with s.accumulate(model) as mb:
                s.backward(nn.functional.cross_entropy(model(x), y))
            stepped.append((micro[0], s.step(opt).stepped, mb.sync))
            micro[0] += 1
            if len(stepped) == steps * k:
                break
        return {"calls": calls, "stepped": stepped}


@pytest.mark.parametrize("k", [1, 4])
def test_one_all_reduce_per_bucket_per_optimizer_step(k: int, pool2) -> None:
    steps = 3
    for r in pool2.run(count_all_reduces, k, steps):
        sync_micro = [m for m, stepped, sync in r["stepped"] if stepped]
        assert sync_micro == [i * k + k - 1 for i in range(steps)], "step on the k-th micro-batch only"
        assert all(stepped == sync for _, stepped, sync in r["stepped"])
        by_micro: dict[int, list[int]] = {}
        for m, bucket in r["calls"]:
            by_micro.setdefault(m, []).append(bucket)
        assert sorted(by_micro) == sync_micro, "an all-reduce ran on a no_sync micro-batch"
        buckets = [sorted(b) for b in by_micro.values()]
        assert all(b == list(range(len(b))) for b in buckets), "a bucket was all-reduced twice in a step"
        assert len(buckets[-1]) >= 2 and len(r["calls"]) == sum(len(b) for b in buckets)


def train_params(k: int, steps: int, max_norm: float | None = None, batch: int = 64) -> dict:
    """Train `steps` optimizer steps with global `batch` split into k micro-batches; return the weights."""
    with ddpkit.session(seed=0, accumulation=k, verbose=False) as s:
        model = s.model(_mlp())
        opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
        norms, done = [], 0
        for x, y in s.loader(_dataset(), batch_size=batch, shuffle=True):
            with s.accumulate(model):
                s.backward(nn.functional.cross_entropy(model(x), y))
            info = s.step(opt, max_norm=max_norm)
            if info.stepped:
                norms.append(info.grad_norm)
                done += 1
            if done == steps:
                break
        return {"params": [p.detach().clone() for p in ddpkit.unwrap(model).parameters()], "norms": norms}


def test_k_micro_batches_of_b_equal_one_batch_of_k_times_b(pool2) -> None:
    one = pool2.run(train_params, 1, 6)[0]["params"]
    four = pool2.run(train_params, 4, 6)[0]["params"]
    diff = max((a - b).abs().max().item() for a, b in zip(one, four, strict=True))
    assert diff < 1e-5, f"accumulation changed the result by {diff:.2e}"
    print(f"accumulation k=4 vs one batch of 4x: max |diff| {diff:.2e}")


def reference_clipped_norms(steps: int, max_norm: float, batch: int) -> list[float]:
    """One process, the full global batch, clipped like s.step: the norms DDP must reproduce."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    sampler = torch.utils.data.DistributedSampler(_dataset(), num_replicas=1, rank=0, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(_dataset(), batch_size=batch, sampler=sampler)
    norms = []
    for x, y in list(loader)[:steps]:
        # rank r of W takes every W-th sample of the same shuffled order: the same samples per step
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        norms.append(nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        opt.step()
    return norms


def test_clipped_norm_is_identical_on_every_rank_and_matches_one_process(pool3) -> None:
    results = pool3.run(train_params, 2, 4, 0.2, 48)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0]["norms"], other["norms"], strict=True))
        assert all(torch.equal(a, b) for a, b in zip(results[0]["params"], other["params"], strict=True))
    ddp_norms = [n.item() for n in results[0]["norms"]]
    assert ddp_norms[0] > 0.2, "the test must actually clip"
    assert ddp_norms == pytest.approx(reference_clipped_norms(4, 0.2, 48), rel=1e-5)


def _single(k: int) -> ddpkit.Session:
    return ddpkit.session(accumulation=k, verbose=False, env={}, hardware=ddpkit.Hardware(0, 2))


def test_misuse_is_refused_with_the_fix() -> None:
    x = torch.randn(4, 10)
    with _single(2) as s:
        model = s.model(_mlp())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(DdpkitError, match=r"outside `with s.accumulate\(model\):` with accumulation=2"):
            s.backward(model(x).sum())
        with pytest.raises(DdpkitError, match=r"s.step\(opt\) was called without a micro-batch"):
            s.step(opt)
        with s.accumulate(model):
            s.backward(model(x).sum())
        previous = r"before `s.step\(opt\)` was called for the previous one"
        with pytest.raises(DdpkitError, match=previous), s.accumulate(model):
            pass
        assert not s.step(opt).stepped
        opt.zero_grad()
        cleared = r"cleared in the middle .* Remove opt.zero_grad\(\)"
        with pytest.raises(DdpkitError, match=cleared), s.accumulate(model):
            s.backward(model(x).sum())
    with _single(1) as s:
        model = s.model(_mlp())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with s.accumulate(model):
            model(x).sum().backward()
        with pytest.raises(DdpkitError, match=r"Call s.backward\(loss\) instead of loss.backward\(\)"):
            s.step(opt)
        s.backward(model(x).sum())  # accumulation=1: no block needed
        assert s.step(opt).stepped


def test_accumulate_refuses_the_unwrapped_module(pool2) -> None:
    assert pool2.run(_accumulate_unwrapped) == ["DdpkitError: s.accumulate got a Sequential"] * 2


def _accumulate_unwrapped() -> str:
    with ddpkit.session(accumulation=2, verbose=False) as s:
        model = s.model(_mlp())
        try:
            with s.accumulate(ddpkit.unwrap(model)):
                pass
        except DdpkitError as exc:
            return f"DdpkitError: {str(exc)[:29]}"
        return "accepted"
