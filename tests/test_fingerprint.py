"""Replica fingerprints: a one-bit flip in one replica's weight is caught within N steps and named.

Real 2-rank DDP on the shared gloo pool: both ranks train the same small MLP; at a known step rank 1
flips one bit of one weight (a device that computed wrongly). The check every N steps must stop both
ranks at the same step, name the tensor, the ranks, and the last step at which they agreed.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ddpkit
from ddpkit.step.fingerprint import ReplicaDrift, ReplicaFingerprints, _groups, tensor_hash

FLIP_STEP, EVERY, STEPS = 5, 4, 12


def _train(every: int, flip_rank: int | None) -> dict:
    """Train STEPS steps under DDP; rank `flip_rank` flips bit 3 of one weight after step FLIP_STEP."""
    with ddpkit.session(seed=0, verbose=False) as s:
        torch.manual_seed(0)
        model = s.model(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        prints = ReplicaFingerprints(every)
        g = torch.Generator().manual_seed(s.rank)
        out: dict = {"stopped": None, "message": "", "checks": 0}
        try:
            for step in range(1, STEPS + 1):
                x, y = torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)
                with s.accumulate(model):
                    s.backward(nn.functional.mse_loss(model(x), y))
                s.step(opt)
                if step == FLIP_STEP and s.rank == flip_rank:
                    w = ddpkit.unwrap(model)[2].weight.data
                    w.view(-1).view(torch.int32)[5] ^= 1 << 3  # one bit of one element
                prints.after_step(step, model, opt)
        except ReplicaDrift as drift:
            out["stopped"], out["message"] = step, str(drift)
        out["checks"], out["last_agreed"] = prints.checks, prints.last_agreed
        return out


def test_a_one_bit_flip_in_one_replica_is_caught_within_n_steps_on_every_rank(pool2) -> None:
    results = pool2.run(_train, EVERY, 1, timeout=120)
    caught = {r["stopped"] for r in results}
    assert caught == {8}, results  # the first check after the flip, the same step on both ranks
    message = results[0]["message"]
    assert "at step 8" in message
    assert "the first tensor that differs is 2.weight" in message, message
    assert "last agreed at step 4" in message and "ranks {0} and ranks {1}" in message, message
    assert results[0]["message"] == results[1]["message"]


def test_replicas_that_agree_are_checked_every_n_steps_and_never_stopped(pool2) -> None:
    results = pool2.run(_train, EVERY, None, timeout=120)
    assert [r["stopped"] for r in results] == [None, None]
    assert [r["checks"] for r in results] == [STEPS // EVERY] * 2
    assert [r["last_agreed"] for r in results] == [12, 12]


def test_a_bit_flip_changes_the_hash_and_the_largest_group_is_named() -> None:
    t = torch.randn(1000)
    flipped = t.clone()
    flipped.view(torch.int32)[999] ^= 1 << 31  # the sign bit of the last element
    assert int(tensor_hash(t)) != int(tensor_hash(flipped))
    assert int(tensor_hash(t)) == int(tensor_hash(t.clone()))
    h = [torch.tensor([1, 2]), torch.tensor([1, 3]), torch.tensor([1, 2])]
    assert _groups((0, 1, 2), h) == [[0, 2], [1]]
    text = ReplicaFingerprints(10).explain(20, ["a", "b"], (0, 1, 2), h)
    assert "rank(s) 1 differ from the 2 others" in text and "first tensor that differs is b" in text


def test_off_and_fsdp_alone_compare_nothing() -> None:
    assert not ReplicaFingerprints(0).due(100)
    with pytest.raises(ddpkit.DdpkitError, match="fingerprint_every=-1"):
        ReplicaFingerprints(-1)
    assert not dist.is_initialized()
    prints = ReplicaFingerprints(1)
    prints.check(3, nn.Linear(2, 2))  # one process: one replica, nothing to compare
    assert prints.checks == 0 and prints.last_agreed == 3


def _sharded(strategy: str, flip: bool) -> dict:
    """FSDP (one replica) or HSDP as 2 replicas x 1 shard: what the fingerprints compare, and a flip."""
    from ddpkit.step.fingerprint import replicas_of
    from ddpkit.strategy.hsdp_options import HSDPOptions

    with ddpkit.session(seed=0, verbose=False) as s:
        chosen = HSDPOptions(replicate=2, shard=1) if strategy == "hsdp" else strategy
        model = s.model(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)), strategy=chosen)
        replicas = replicas_of(model)
        prints = ReplicaFingerprints(1)
        if flip and s.rank == 1:
            local = ddpkit.unwrap(model)[0].weight.to_local()
            local.view(-1).view(torch.int32)[0] ^= 1
        try:
            prints.check(1, model)
            message = ""
        except ReplicaDrift as drift:
            message = str(drift)
        return {"count": replicas.count, "why": replicas.why, "checks": prints.checks, "message": message}


def test_fsdp_alone_has_one_replica_and_hsdp_compares_its_replicate_dimension(pool2) -> None:
    fsdp = pool2.run(_sharded, "fsdp", True, timeout=120)
    assert [r["count"] for r in fsdp] == [1, 1] and "FSDP holds one replica" in fsdp[0]["why"]
    assert [r["checks"] for r in fsdp] == [0, 0] and fsdp[0]["message"] == ""
    hsdp = pool2.run(_sharded, "hsdp", True, timeout=120)
    assert [r["count"] for r in hsdp] == [2, 2] and "HSDP: 2 replicas" in hsdp[0]["why"], hsdp
    assert "first tensor that differs is 0.weight" in hsdp[0]["message"], hsdp
    assert hsdp[0]["message"] == hsdp[1]["message"]


def _session_loop(root: str, every: int, saves: bool) -> dict:
    """`ddpkit.session(fingerprint_every=)` in a hand loop: rank 1 flips a bit after step 5; with `saves`,
    saves at 4 and 6 (the save compares first, so nothing drifted is written)."""
    from pathlib import Path

    with ddpkit.session(seed=0, verbose=False, log_to=None, fingerprint_every=every) as s:
        torch.manual_seed(0)
        model = s.model(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)))
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(s.rank)
        out: dict = {"stopped": None, "message": ""}
        try:
            for step in range(1, STEPS + 1):
                x, y = torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)
                with s.accumulate(model):
                    s.backward(nn.functional.mse_loss(model(x), y))
                s.step(opt)
                if step == FLIP_STEP and s.rank == 1:
                    ddpkit.unwrap(model)[0].weight.data.view(-1).view(torch.int32)[0] ^= 1 << 20
                if saves and step in (4, 6):
                    s.save(str(Path(root) / f"at{step}"), model=model, optimizer=opt, step=step)
        except ReplicaDrift as drift:
            out["stopped"], out["message"] = step, str(drift)
        out["saved"] = sorted(p.name for p in Path(root).iterdir()) if Path(root).exists() else []
        return out


def test_the_session_option_stops_every_rank_and_saves_nothing_after_the_drift(pool2, tmp_path) -> None:
    results = pool2.run(_session_loop, str(tmp_path), 100, True, timeout=120)
    assert [r["stopped"] for r in results] == [6, 6], results  # at the save of step 6, before writing
    assert "last agreed at step 4" in results[0]["message"] and "0.weight" in results[0]["message"]
    assert results[0]["saved"] == ["at4"], results


def test_the_stepper_compares_every_n_steps_after_the_optimizer_step(pool2, tmp_path) -> None:
    results = pool2.run(_session_loop, str(tmp_path), 3, False, timeout=120)
    assert [r["stopped"] for r in results] == [6, 6], results  # checks at 3 (agreed) and 6
    assert "last agreed at step 3" in results[0]["message"], results
