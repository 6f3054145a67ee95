"""`HSDPOptions(shm=True)`: each shard group's all-gathers and reduce-scatters go through a shared-memory
segment of its own, the replicas' all-reduce stays on gloo. HSDP 2 x 2 on 4 ranks, each rank its own
batch: the weights are gloo HSDP's within rounding (as tests/test_fsdp_shm.py compares), the replicas bitwise equal, and the
shared-memory path was active (its collectives counted, none handed back to gloo); with "auto" (the
default) nothing goes through it."""

from __future__ import annotations

import io
from contextlib import redirect_stdout

import pytest
import torch
from fsdp_train import full_params
from torch import nn

import ddpkit
from ddpkit.strategy import HSDPOptions

pytestmark = pytest.mark.numerics


def hsdp_steps(shm: bool | str, steps: int = 3) -> dict:
    said = io.StringIO()
    with (
        redirect_stdout(said),
        ddpkit.session(seed=0, strategy=HSDPOptions(replicate=2, shard=2, shm=shm)) as s,
    ):
        torch.manual_seed(0)
        model = s.model(nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 4)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(10 + s.rank)  # each rank its own batch
        for _ in range(steps):
            x = torch.randn(4, 8, generator=g)
            s.backward(nn.functional.mse_loss(model(x), torch.zeros(4, 4)))
            s.step(opt)
        comms = s.strategy.shm_comms
        counts = None if comms is None else (comms.all_gathers, comms.reduce_scatters, comms.fallbacks)
        return {"weights": full_params(model), "counts": counts, "said": said.getvalue()}


def test_hsdp_shm_true_takes_the_shard_groups_through_shared_memory(pool4) -> None:
    shm = pool4.run(hsdp_steps, True, timeout=120)
    gloo = pool4.run(hsdp_steps, "auto", timeout=120)
    for rank, (a, b) in enumerate(zip(shm, gloo, strict=True)):
        ag, rs, fallbacks = a["counts"]
        assert ag >= 3 and rs >= 3 and fallbacks == 0, (rank, a["counts"])  # one of each a step at least
        assert b["counts"] is None, "'auto' under HSDP mapped shared memory"
        assert "HSDP, in each shard group: FSDP2 collectives (all-gather, reduce-scatter) through shared" in (
            a["said"] if rank == 0 else shm[0]["said"]
        )
        for name in a["weights"]:
            assert torch.allclose(a["weights"][name], b["weights"][name], rtol=1e-5, atol=1e-5), (rank, name)
            assert torch.equal(a["weights"][name], shm[0]["weights"][name]), f"replica {rank} differs: {name}"
