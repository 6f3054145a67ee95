"""The spike guard's rollback remedy on real gloo ranks: a planted bad batch makes every rank load the last
checkpoint and leave that batch's samples out, ending where a run whose data never had the batch ends;
the skipped samples are listed in later checkpoints; a relaunch from the checkpoint taken before the spike
decides the same and ends bit for bit where the first run ended, and so does a resume from a checkpoint
taken after the rollback. The loader's skip, by global sample position, at world sizes 1, 2 and 4."""

from __future__ import annotations

import pytest
import torch
from test_spikes import GLOBAL, PLANT, STEPS, _data, _distance
from torch import nn
from torch.nn import functional as F

import ddpkit
from ddpkit.data import BatchPlan, make_loader
from ddpkit.errors import DdpkitError

pytestmark = pytest.mark.numerics

SAVE_EVERY = 5  # the callback's checkpoints: steps 5, 10, 15; the spike at 12 rolls back to step 10
BAD = ((PLANT - 1) * GLOBAL, PLANT * GLOBAL)  # the planted batch's global samples in epoch 0


class _Saver(ddpkit.Callback):
    def __init__(self, root: str, things: dict) -> None:
        self.root, self.things = root, things
        self.saved: list[tuple[int, str]] = []

    def on_step_end(self, state: ddpkit.FitState) -> None:
        if state.step % SAVE_EVERY == 0:
            self.saved.append((state.step, str(state.s.save(self.root, **self.things))))


def train(planted: bool, removed: bool, remedy: str | None, root: str = "", start: str = "") -> dict:
    """One epoch under `fit` on every rank; `root`: checkpoints every SAVE_EVERY steps; `start`: the
    checkpoint to begin from (a relaunch)."""
    guard = ddpkit.SpikeGuard(window=20, warmup=5, remedy=remedy) if remedy else None
    with ddpkit.session(seed=0, verbose=False, log_to=None, spike_guard=guard) as s:
        model = s.model(nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3)))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        loader = s.loader(_data(planted, removed), batch_size=GLOBAL)
        things = {"model": model, "optimizer": opt, "stepper": s.stepper, "loader": loader}
        if start:
            s.load(start, **things)
        listed = loader.skipped  # what the checkpoint listed (empty on a fresh start)
        saver = _Saver(root, things)

        def train_step(m: nn.Module, batch: tuple) -> torch.Tensor:
            return F.cross_entropy(m(batch[0]), batch[1])

        result = ddpkit.fit(s, model, opt, loader, train_step, epochs=1, progress=False, flops=None,
                            callbacks=[saver] if root else [])  # fmt: skip
        judge = s.stepper.spikes
        return {
            "weights": {k: v.clone() for k, v in ddpkit.unwrap(model).state_dict().items()},
            "events": [(e.step, e.name, e.rollback) for e in judge.events] if judge is not None else [],
            "steps": s.stepper.steps,
            "listed": listed,
            "skipped": loader.skipped,
            "saved": saver.saved,
            "losses": result.losses,
        }


@pytest.fixture(scope="module")
def runs(pool2, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = str(tmp_path_factory.mktemp("rollback") / "ckpt")
    return {
        "clean": pool2.run(train, False, True, None),  # the data without the bad batch
        "rolled": pool2.run(train, True, False, "rollback", root),
        "root": root,
    }


def test_a_rollback_leaves_the_bad_batch_out_and_ends_where_a_run_without_it_ends(runs) -> None:
    clean, rolled = runs["clean"], runs["rolled"]
    scale = sum(float(v.double().norm() ** 2) for v in clean[0]["weights"].values()) ** 0.5
    near = _distance(rolled[0]["weights"], clean[0]["weights"])
    print(f"rolled back run: {near:.4g} from the run without the bad batch (weights' norm {scale:.4g})")
    assert near <= 1e-6 * scale, "the rolled-back run should end where the run that never saw the batch ends"
    for r in rolled:  # every rank: one spike, one rollback, the same range, the same weights
        assert r["events"] == [(PLANT, "loss", True)], r["events"]
        assert r["skipped"] == [(0, *BAD)] and r["steps"] == clean[0]["steps"] == STEPS - 1
        assert all(torch.equal(r["weights"][k], rolled[0]["weights"][k]) for k in r["weights"])
    # steps 5 and 10 saved before the spike; after the rollback to 10, 10 is not saved again, 15 is
    assert [step for step, _ in rolled[0]["saved"]] == [5, 10, 15]
    # the losses of the final path: the rolled-back steps are gone (a plain skip would keep the spike's)
    losses, without = torch.tensor(rolled[0]["losses"]), torch.tensor(clean[0]["losses"])
    assert losses.shape == without.shape and torch.allclose(losses, without, rtol=1e-6, atol=0)


def test_a_relaunch_from_before_the_spike_rolls_back_the_same_and_ends_bitwise_equal(pool2, runs) -> None:
    first = runs["rolled"]
    before = dict(first[0]["saved"])[10]  # the checkpoint the rollback went back to
    again = pool2.run(train, True, False, "rollback", "", before)
    for a, r in zip(again, first, strict=True):
        assert a["listed"] == [] and a["events"] == [(PLANT, "loss", True)] and a["skipped"] == [(0, *BAD)]
        assert all(torch.equal(a["weights"][k], r["weights"][k]) for k in r["weights"]), "not bitwise equal"


def test_a_resume_after_the_rollback_keeps_the_skip_listed_in_the_checkpoint(pool2, runs) -> None:
    first = runs["rolled"]
    after = dict(first[0]["saved"])[15]
    resumed = pool2.run(train, True, False, "rollback", "", after)
    for a, r in zip(resumed, first, strict=True):
        assert a["listed"] == [(0, *BAD)] and a["events"] == [], a
        assert all(torch.equal(a["weights"][k], r["weights"][k]) for k in r["weights"]), "not bitwise equal"


def _global_order(world: int, skipped: tuple[int, int, int] | None, resume: dict | None = None) -> list[int]:
    """Every rank's samples of one pass, interleaved back into the global order (one process)."""
    data = torch.utils.data.TensorDataset(torch.arange(64))
    loaders = [make_loader(data, BatchPlan(8 // world, world, 1), rank=r, device=torch.device("cpu"), seed=0,
                           shuffle=True) for r in range(world)]  # fmt: skip
    for loader in loaders:
        if resume is not None:
            loader.load_state_dict(resume)
        if skipped is not None:
            loader.skip_samples(*skipped)
    passes = [[batch[0].tolist() for batch in loader] for loader in loaders]  # rank r holds r, r+W, ...
    return [i for step in zip(*passes, strict=True) for row in zip(*step, strict=True) for i in row]


def test_the_loaders_skip_holds_at_any_world_size_and_across_a_resume() -> None:
    whole = _global_order(1, None)
    assert sorted(whole) == list(range(64))
    want = whole[:16] + whole[24:]  # global samples [16, 24) of epoch 0 left out
    for world in (1, 2, 4):
        got = _global_order(world, (0, 16, 24))
        assert got == want, world
    # a position saved at world 2 before the range (8 samples in) with the range listed: resumed at 4
    data = torch.utils.data.TensorDataset(torch.arange(64))
    two = make_loader(data, BatchPlan(4, 2, 1), rank=0, device=torch.device("cpu"), seed=0, shuffle=True)
    two.skip_samples(0, 16, 24)
    it = iter(two)
    next(it)
    saved = two.state_dict()
    assert saved["samples"] == 8 and saved["skipped"] == [[0, 16, 24]]
    assert _global_order(4, None, saved) == want[8:]
    with pytest.raises(DdpkitError, match="empty or negative"):
        two.skip_samples(0, 5, 5)


def test_a_rollback_to_a_checkpoint_without_the_loader_or_to_another_loader_is_refused(tmp_path) -> None:
    guard = ddpkit.SpikeGuard(window=20, warmup=5, remedy="rollback")
    with ddpkit.session(seed=0, verbose=False, log_to=None, spike_guard=guard) as s:
        model = s.model(nn.Linear(10, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        loader = s.loader(_data(True), batch_size=GLOBAL)
        s.save(str(tmp_path / "ckpt"), model=model, optimizer=opt, stepper=s.stepper)  # no loader=

        def train_step(m: nn.Module, batch: tuple) -> torch.Tensor:
            return F.cross_entropy(m(batch[0]), batch[1])

        with pytest.raises(DdpkitError, match="loader=the training loader"):
            ddpkit.fit(s, model, opt, loader, train_step, epochs=1, progress=False, flops=None)
        with pytest.raises(DdpkitError, match="needs the training loader to be ddpkit's"):
            ddpkit.fit(s, model, opt, list(loader), train_step, epochs=1, progress=False, flops=None)
