"""FSDP2's all-gather and reduce-scatter through shared memory (ddpkit.parallel.fsdp_shm): the path is taken on
CPU ranks of one machine, replicas are bitwise equal, the weights are gloo FSDP's and one process's
within tolerance, with accumulation and at 3 ranks; FSDPOptions(shm=False) keeps gloo."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from fsdp_train import data, full_params, net
from torch.distributed.fsdp import FSDPModule

import ddpkit
from ddpkit.parallel import fsdp_shm
from ddpkit.parallel.shm_allreduce import ShmAllReduce
from ddpkit.strategy import FSDPOptions

pytestmark = pytest.mark.numerics  # .ci/run runs these again under ATEN_CPU_CAPABILITY=default


@contextlib.contextmanager
def _shared_gather(on: bool):
    """fsdp_shm.SHARED_GATHER in the pool's (persistent) process, set back to its default after."""
    fsdp_shm.SHARED_GATHER = on
    try:
        yield
    finally:
        fsdp_shm.SHARED_GATHER = True


def train(
    shm,
    accumulation: int = 1,
    steps: int = 4,
    precision: str = "32",
    shared_gather: bool = True,
    prefetch: int = 0,
    d: int = 16,
) -> dict:
    """AdamW with clipping on fsdp_train's net (every Linear its own unit; `prefetch` blocks ahead, set
    explicitly, forward and backward); what the collectives did."""
    out = io.StringIO()
    with (
        _shared_gather(shared_gather),
        contextlib.redirect_stdout(out),
        ddpkit.session(seed=0, accumulation=accumulation, precision=precision) as s,
    ):
        model = s.model(net(d), strategy=FSDPOptions(min_block_params=1, shm=shm))
        units = [m for m in model.modules() if isinstance(m, FSDPModule)][1:]  # forward order, no root
        for i, unit in enumerate(units if prefetch else []):
            unit.set_modules_to_forward_prefetch(units[i + 1 : i + 1 + prefetch])
            unit.set_modules_to_backward_prefetch(units[max(0, i - prefetch) : i][::-1])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        it = iter(s.loader(data(), batch_size=12, shuffle=True))
        norms = []
        for _ in range(steps * accumulation):
            x, y = next(it)
            with s.accumulate(model):
                s.backward(F.cross_entropy(model(x), y))
            info = s.step(opt, max_norm=0.5)
            if info.stepped:
                norms.append(float(info.grad_norm))  # type: ignore[arg-type]
        comms = s.strategy.shm_comms  # type: ignore[attr-defined]
        counts = (0, 0, 0) if comms is None else (comms.all_gathers, comms.reduce_scatters, comms.fallbacks)
        shared = 0 if comms is None else comms.shared_gathers
        held = 0 if comms is None else comms.held
        region = 0 if comms is None or comms.gather is None else comms.gather.world * comms.gather.chunk_bytes
        params = full_params(model)
    closed = comms is None or not comms.shm.active  # the session's end unmapped the segment
    closed &= comms is None or comms.gather is None or not comms.gather.active
    return {
        "params": params,
        "norms": norms,
        "counts": counts,
        "shared": shared,
        "held": held,
        "region": region,
        "printed": out.getvalue(),
        "closed": closed,
    }


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def _close(a: dict, b: dict, tol: float = 1e-5) -> list[str]:
    return [k for k in a if not torch.allclose(a[k], b[k], rtol=tol, atol=tol)]


@pytest.mark.parametrize("accumulation", [1, 2])
def test_fsdp_over_shm_trains_gloo_fsdp_weights_with_identical_replicas(pool2, accumulation: int) -> None:
    on = pool2.run(train, "auto", accumulation, timeout=120)
    off = pool2.run(train, False, accumulation, timeout=120)
    units = 5  # the 5 Linears of fsdp_train.net (2 + 3 in blocks); the root holds no parameter
    for r in on:  # every step: 2 all-gathers per unit (forward, backward), 1 reduce-scatter per unit
        ag, rs, fallbacks = r["counts"]
        assert rs == 4 * units and ag >= 4 * units and fallbacks == 0, r["counts"]
        assert r["shared"] == ag, "an all-gather output was not in the shared segment"
    assert "through shared memory" in on[0]["printed"], on[0]["printed"]
    assert all(r["closed"] for r in on), "the segment outlived the session"
    assert all(_same(on[0]["params"], r["params"]) for r in on), "replicas differ across ranks"
    assert on[0]["norms"] == on[1]["norms"], "the clipped norm differs between ranks"
    assert _close(on[0]["params"], off[0]["params"]) == [], "shm FSDP left gloo FSDP's weights"
    assert torch.allclose(torch.tensor(on[0]["norms"]), torch.tensor(off[0]["norms"]), rtol=1e-5)


def test_all_gather_output_in_shared_memory_gives_the_slots_bytes(pool2) -> None:
    """The all-gather output in the shared segment (FSDP2's copy-in is the publishing) trains bitwise the
    weights of the private output filled through the slots: both are byte copies of the same shards."""
    shared = pool2.run(train, "auto", 1, 3, timeout=120)
    slots = pool2.run(train, "auto", 1, 3, "32", False, timeout=120)
    assert all(r["shared"] > 0 for r in shared) and all(r["shared"] == 0 for r in slots)
    assert "all-gather outputs in shared memory" in shared[0]["printed"]
    assert all(_same(shared[0]["params"], r["params"]) for r in shared + slots)
    assert shared[0]["norms"] == slots[0]["norms"]


@pytest.mark.parametrize("prefetch", [1, 2, 3])
def test_shared_all_gather_output_grows_and_takes_explicit_prefetching(pool2, prefetch: int) -> None:
    """Blocks of 64 x 64 after a first unit of 8 x 64: the segment is mapped for the first all-gather and
    mapped again, larger, for the next; FSDP2 prefetching 1 block ahead (forward and backward) finds
    every region released by every rank before it is written again; 2 or 3 ahead find some still held
    and take those all-gathers through the slots: the slots path's bytes in every case."""
    shared = pool2.run(train, "auto", 1, 3, "32", True, prefetch, 64, timeout=120)
    slots = pool2.run(train, "auto", 1, 3, "32", False, prefetch, 64, timeout=120)
    assert all(r["region"] >= 4 * (64 * 64 + 64) and r["shared"] > 0 for r in shared)
    assert all(
        (r["held"] > 0) == (prefetch > 1) and r["shared"] + r["held"] == r["counts"][0] for r in shared
    )
    assert all(_same(shared[0]["params"], r["params"]) for r in shared + slots)
    assert shared[0]["norms"] == slots[0]["norms"]


def test_fsdp_over_shm_at_three_ranks(pool3) -> None:
    on = pool3.run(train, True, 2, timeout=120)
    off = pool3.run(train, False, 2, timeout=120)
    assert all(r["counts"][1] > 0 and r["counts"][2] == 0 for r in on), [r["counts"] for r in on]
    assert all(r["shared"] == r["counts"][0] for r in on)
    assert all(_same(on[0]["params"], r["params"]) for r in on), "replicas differ across ranks"
    assert _close(on[0]["params"], off[0]["params"]) == []


def test_fsdp_over_shm_in_bf16(pool2) -> None:
    """bf16 compute: bf16 all-gathers (bytes), fp32 reduce-scatters (AVG) through shared memory."""
    on = pool2.run(train, "auto", 1, 3, "bf16", timeout=120)
    off = pool2.run(train, False, 1, 3, "bf16", timeout=120)
    assert all(r["counts"][0] > 0 and r["counts"][1] > 0 and r["counts"][2] == 0 for r in on)
    assert _same(on[0]["params"], on[1]["params"]), "replicas differ across ranks"
    assert _close(on[0]["params"], off[0]["params"], tol=1e-3) == []


def test_fsdp_shm_off_keeps_gloo(pool2) -> None:
    off = pool2.run(train, False, 1, 2, timeout=120)
    assert [r["counts"] for r in off] == [(0, 0, 0), (0, 0, 0)]
    assert "FSDP2 collectives over gloo (FSDPOptions(shm=False))" in off[0]["printed"], off[0]["printed"]
    with pytest.raises(ddpkit.DdpkitError, match="shm='yes'"):
        FSDPOptions(shm="yes")


def test_verify_fsdp_passes_with_the_shm_path_on(pool2) -> None:
    """`ddpkit verify --strategy fsdp`: FSDP (the default shm="auto", taken: checked by a run of the same
    session default) against one process, within verify's tolerance."""
    from ddpkit.verify import VerifySpec, verify

    spec = VerifySpec(
        model=net, data=data, optimizer="adamw", steps=6, batch_size=12, nproc=2, strategy="fsdp"
    )
    report = verify(spec, runner=pool2.run)
    assert report.passed and report.replicas_identical, report.render()
    assert all(r["counts"][1] > 0 for r in pool2.run(default_path, timeout=120))


def default_path() -> dict:
    with ddpkit.session(seed=0, verbose=False, strategy="fsdp") as s:
        model = s.model(net())
        x, y = next(iter(s.loader(data(), batch_size=12)))
        s.backward(F.cross_entropy(model(x), y))
        comms = s.strategy.shm_comms  # type: ignore[attr-defined]
        return {"counts": (0, 0, 0) if comms is None else (comms.all_gathers, comms.reduce_scatters, 0)}


def scatter_and_gather(seed: int) -> bool:
    """reduce_scatter_into_ is bitwise all_reduce_mean_'s chunk (sizes across chunk boundaries);
    all_gather_into_ gives every rank every chunk's bytes (uint8 and float)."""
    shm = ShmAllReduce(chunk_mb=0.004)  # 4 KiB chunks
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        g = torch.Generator().manual_seed(seed + rank)
        ok = True
        for m in (1, 341, 1000, 2049):
            full = torch.randn(world * m, generator=g)
            out = torch.empty(m)
            before = full.clone()
            shm.reduce_scatter_into_(full, out)
            ok &= torch.equal(full, before)
            ok &= torch.equal(out, shm.all_reduce_mean_(full.clone())[rank * m : (rank + 1) * m])
            for dtype in (torch.uint8, torch.float32):
                want = torch.arange(world * m).to(dtype)
                gathered = torch.zeros(world * m, dtype=dtype)
                gathered[rank * m : (rank + 1) * m] = want[rank * m : (rank + 1) * m]
                ok &= torch.equal(shm.all_gather_into_(gathered), want)
        return bool(ok)
    finally:
        shm.close()


def test_shm_reduce_scatter_and_all_gather_are_exact(pool3) -> None:
    assert pool3.run(scatter_and_gather, 7, timeout=60) == [True, True, True]
