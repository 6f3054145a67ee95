"""`ddpkit.fit` after a replica drift: back to the last checkpoint written while the replicas agreed.

Real 2-rank DDP under `fit` with `session(fingerprint_every=3)` and a callback saving every 4 steps. After
optimizer step 7 rank 1 flips one bit of one weight (a device that computed wrongly). The save of step 8
compares first and sees it (within 3 steps): nothing is written, the tensor is named, every rank rolls
back to the checkpoint of step 4 (the last written while the replicas agreed, though they last agreed at
the check of step 6), compares the replicas there and trains on. With the flip not re-applied, the run
ends with the replicas equal, bitwise equal to the run that never flipped (same world size, the same
computation replayed). A flip after step 5, seen inside s.step at 6 and re-applied on every pass (a cause
in the computation), stops the run at the second drift at the same step; on_drift="stop" at the first.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.step.fingerprint import ReplicaDrift

pytestmark = pytest.mark.numerics

EVERY, SAVE_EVERY, STEPS, GLOBAL = 3, 4, 12, 8


class _Flip(ddpkit.Callback):
    """Rank 1 flips bit 3 of one element of `blocks.2.weight` after step `after` (once, or each pass)."""

    def __init__(self, model: nn.Module, after: int, always: bool) -> None:
        self.model, self.after, self.always, self.flips = model, after, always, 0

    def on_step_end(self, state: ddpkit.FitState) -> None:
        if state.step == self.after and state.s.rank == 1 and (self.always or not self.flips):
            weight = ddpkit.unwrap(self.model).blocks[2].weight
            local = weight.to_local() if hasattr(weight, "to_local") else weight.data  # HSDP: its shard
            local.view(-1).view(torch.int32)[7] ^= 1 << 3
            self.flips += 1


class _Saver(ddpkit.Callback):
    def __init__(self, root: str, things: dict) -> None:
        self.root, self.things, self.saved = root, things, []

    def on_step_end(self, state: ddpkit.FitState) -> None:
        if state.step % SAVE_EVERY == 0:
            state.s.save(self.root, **self.things)
            self.saved.append(state.step)


def _train(
    root: str,
    flip: str | None,
    after: int = 7,
    on_drift: str = "rollback",
    saves: bool = True,
    strategy: str = "ddp",
) -> dict:
    """STEPS steps of one shuffled epoch under fit; `flip` after step `after`: None, "once" or "always";
    `strategy` "hsdp": 2 replicas x 2 shards (4 ranks), the checkpoints through DCP."""
    from ddpkit.strategy.hsdp_options import HSDPOptions

    with ddpkit.session(seed=0, verbose=False, log_to=None, fingerprint_every=EVERY) as s:
        torch.manual_seed(0)
        net = nn.Sequential()
        net.add_module("blocks", nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh()))
        net.add_module("head", nn.Linear(16, 3))
        model = s.model(net, strategy=HSDPOptions(replicate=2, shard=2) if strategy == "hsdp" else "ddp")
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        g = torch.Generator().manual_seed(1)
        data = TensorDataset(
            torch.randn(STEPS * GLOBAL, 6, generator=g), torch.randint(0, 3, (STEPS * GLOBAL,), generator=g)
        )
        loader = s.loader(data, batch_size=GLOBAL, shuffle=True)
        saver = _Saver(root, {"model": model, "optimizer": opt, "stepper": s.stepper, "loader": loader})
        flipper = _Flip(model, after, flip == "always")
        printed: list[str] = []
        s.print = lambda *a, **k: printed.append(" ".join(map(str, a)))  # type: ignore[method-assign]
        out: dict = {"error": "", "printed": printed, "saved": saver.saved}

        def train_step(m: nn.Module, batch: tuple) -> torch.Tensor:
            return F.cross_entropy(m(batch[0]), batch[1])

        try:
            result = ddpkit.fit(
                s, model, opt, loader, train_step, epochs=1, progress=False, flops=None,
                callbacks=[*([flipper] if flip else []), *([saver] if saves else [])], on_drift=on_drift,
            )  # fmt: skip
            out.update(steps=result.steps, losses=result.losses, flips=flipper.flips)
        except ReplicaDrift as drift:
            out.update(error=str(drift), at=drift.step, tensor=drift.tensor)
        out["weights"] = {  # this rank's copy (HSDP: its shard)
            k: (v.to_local() if hasattr(v, "to_local") else v).clone()
            for k, v in ddpkit.unwrap(model).state_dict().items()
        }
        out["session_steps"], out["agreed"] = s.stepper.steps, s.stepper.fingerprints.last_agreed
        return out


@pytest.fixture(scope="module")
def runs(pool2, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("drift")
    return {
        "clean": pool2.run(_train, str(root / "clean"), None, timeout=180),
        "flipped": pool2.run(_train, str(root / "flipped"), "once", timeout=180),
    }


def test_a_bit_flip_under_fit_rolls_back_to_the_last_agreeing_checkpoint_and_ends_bitwise_equal(runs) -> None:
    clean, flipped = runs["clean"], runs["flipped"]
    for r in flipped:
        assert r["error"] == "" and r["flips"] == (1 if r is flipped[1] else 0), r["error"]
        assert r["steps"] == r["session_steps"] == STEPS
    said = [line for line in flipped[0]["printed"] if "the replicas drifted" in line]
    assert len(said) == 1, flipped[0]["printed"]
    # seen at the first check after the flip, the save of step 8 (within EVERY steps), which wrote nothing:
    # the newest checkpoint, the rollback's target, is still step 4's; named; compared again there
    first = (
        "drifted at optimizer step 8 (first in blocks.2.weight; no majority; the last agreement at step 6)"
    )
    assert first in said[0], said
    assert "(optimizer step 4, written while they agreed; 4 step(s) undone)" in said[0], said
    assert "compared equal again at step 4" in said[0], said
    assert flipped[0]["saved"] == [4, 8, 12] == clean[0]["saved"]  # 8 and 12 on the replayed path
    # the replicas equal at the end, and bitwise equal to the run that never flipped (same world size)
    for r in flipped:
        for k, v in clean[0]["weights"].items():
            assert torch.equal(r["weights"][k], v), k
    assert flipped[0]["losses"] == clean[0]["losses"] and len(clean[0]["losses"]) == STEPS
    assert [r["agreed"] for r in flipped] == [STEPS, STEPS]  # the fingerprints were on to the end


def test_a_drift_that_replays_or_has_no_checkpoint_stops_and_on_drift_stop_stops_at_once(
    pool2, tmp_path
) -> None:
    again = pool2.run(_train, str(tmp_path / "again"), "always", 5, timeout=180)
    for r in again:
        assert r["at"] == 6 and "drifted again at optimizer step 6" in r["error"], r["error"]
        assert "the first tensor that differs is blocks.2.weight" in r["error"]
        assert r["saved"] == [4], r["saved"]  # the replay drifted before the save at 8
    stop = pool2.run(_train, str(tmp_path / "stop"), "once", 5, "stop", timeout=180)
    for r in stop:
        assert r["at"] == 6 and "did not roll back" not in r["error"] and r["tensor"] == "blocks.2.weight"
        assert not any("the replicas drifted" in line for line in r["printed"]) and r["saved"] == [4]
    unsaved = pool2.run(_train, str(tmp_path / "none"), "once", 5, "rollback", False, timeout=180)
    for r in unsaved:  # nothing to roll back to: the drift, saying why and what to do
        assert r["at"] == 6 and "did not roll back: no checkpoint was saved or loaded" in r["error"], r
        assert "s.save(root, model=, optimizer=, stepper=s.stepper, loader=)" in r["error"]
    with pytest.raises(ddpkit.DdpkitError, match="on_drift='stop'"):
        ddpkit.fit(None, None, None, [], None, epochs=1, on_drift="never")  # type: ignore[arg-type]


def test_under_hsdp_the_drifted_replica_group_rolls_back_every_rank_and_ends_bitwise_equal(
    pool4, tmp_path
) -> None:
    clean = pool4.run(_train, str(tmp_path / "clean"), None, 7, "rollback", True, "hsdp", timeout=240)
    flipped = pool4.run(_train, str(tmp_path / "flipped"), "once", 7, "rollback", True, "hsdp", timeout=240)
    said = [line for line in flipped[0]["printed"] if "the replicas drifted" in line]
    assert len(said) == 1 and "drifted at optimizer step 8 (first in blocks.2.weight;" in said[0], said
    assert "(optimizer step 4, written while they agreed" in said[0], said
    for r, c in zip(flipped, clean, strict=True):  # every rank, its own shard: as the run that never flipped
        assert r["error"] == "" and r["steps"] == STEPS and r["saved"] == [4, 8, 12]
        assert all(torch.equal(r["weights"][k], v) for k, v in c["weights"].items())
