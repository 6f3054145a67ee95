"""The spike guard's rollback remedy on real gloo ranks: a planted bad batch makes every rank load the last
checkpoint and leave that batch's samples out, ending where a run whose data never had the batch ends;
the skipped samples are listed in later checkpoints; a relaunch from the checkpoint taken before the spike
decides the same and ends bit for bit where the first run ended, and so does a resume from a checkpoint
taken after the rollback. The loader's skip, by global sample position, at world sizes 1, 2 and 4."""

from __future__ import annotations

import math

import pytest
import torch
from test_spikes import GLOBAL, PLANT, STEPS, _data, _distance
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.data import BatchPlan, make_loader
from ddpkit.errors import DdpkitError

pytestmark = pytest.mark.numerics

SAVE_EVERY = 5  # the callback's checkpoints: steps 5, 10, 15; the spike at 12 rolls back to step 10
BAD = ((PLANT - 1) * GLOBAL, PLANT * GLOBAL)  # the planted batch's global samples in epoch 0


class _Saver(ddpkit.Callback):
    def __init__(self, root: str, things: dict, at: set[int] | None = None) -> None:
        self.root, self.things, self.at = root, things, at
        self.saved: list[tuple[int, str]] = []

    def on_step_end(self, state: ddpkit.FitState) -> None:
        if state.step in self.at if self.at is not None else state.step % SAVE_EVERY == 0:
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

        result = ddpkit.fit(
            s,
            model,
            opt,
            loader,
            train_step,
            epochs=1,
            progress=False,
            flops=None,
            callbacks=[saver] if root else [],
        )
        return {**_outcome(s, model, loader, saver, result), "listed": listed}


def _outcome(s, model, loader, saver, result) -> dict:
    """What a run returns to the test: its weights, the guard's events, steps, skips, saves and losses."""
    judge = s.stepper.spikes
    return {
        "weights": {k: v.clone() for k, v in ddpkit.unwrap(model).state_dict().items()},
        "events": [(e.step, e.name, e.rollback) for e in judge.events] if judge is not None else [],
        "steps": s.stepper.steps,
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
    loaders = [
        make_loader(
            data, BatchPlan(8 // world, world, 1), rank=r, device=torch.device("cpu"), seed=0, shuffle=True
        )
        for r in range(world)
    ]
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


# -- a rollback across an epoch boundary: the checkpoint in epoch 0, the bad batch in epoch 1 -------------
PER_EPOCH = (
    10  # global batches per epoch; 2 epochs, shuffled (each epoch's order a function of (seed, epoch))
)
BAD_AT = 2  # the bad batch: global batch BAD_AT (0-based) of epoch 1, optimizer step PER_EPOCH + BAD_AT + 1
BAD_1 = (1, BAD_AT * GLOBAL, (BAD_AT + 1) * GLOBAL)  # its global samples in epoch 1's order
# the first sample of that batch, by DistributedSampler's order (seed 0 + epoch 1; at world 2 rank r reads
# r, r+2, ..., so the global order is the permutation itself): scaled by 1e4 when epoch 1 reads it
TARGET = int(torch.randperm(PER_EPOCH * GLOBAL, generator=torch.Generator().manual_seed(1))[BAD_AT * GLOBAL])


def train_epochs(
    remedy: str | None,
    root: str = "",
    save_at: int = 0,
    start: str = "",
    left_out: tuple[int, int, int] | None = None,
) -> dict:
    """Two shuffled epochs under `fit` on every rank; sample TARGET is bad in epoch 1 only. `save_at`: the
    step the callback saves at (in `root`); `start`: a checkpoint to begin from; `left_out`: global
    samples the loader leaves out from the start (the run whose data never had the bad batch)."""
    guard = ddpkit.SpikeGuard(window=20, warmup=5, remedy=remedy) if remedy else None
    g = torch.Generator().manual_seed(0)
    n = PER_EPOCH * GLOBAL
    data = TensorDataset(
        torch.randn(n, 10, generator=g), torch.randint(0, 3, (n,), generator=g), torch.arange(n)
    )
    with ddpkit.session(seed=0, verbose=False, log_to=None, spike_guard=guard) as s:
        model = s.model(nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3)))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        loader = s.loader(data, batch_size=GLOBAL, shuffle=True)
        things = {"model": model, "optimizer": opt, "stepper": s.stepper, "loader": loader}
        if start:
            s.load(start, **things)
        if left_out is not None:
            loader.skip_samples(*left_out)
        saver = _Saver(root, things, {save_at})
        seen: list[tuple[int, int]] = []  # (epoch, global samples read) of every micro-batch trained on

        def train_step(m: nn.Module, batch: tuple) -> torch.Tensor:
            x, y, i = batch
            epoch, end = loader.position
            seen.append((epoch, end))
            if epoch == 1:  # the bad sample spikes in epoch 1 only
                x = torch.where((i == TARGET)[:, None], x * 1e4, x)
            return F.cross_entropy(m(x), y)

        def eval_step(m: nn.Module, batch: tuple, metrics: dict) -> None:
            metrics["loss"].update(F.cross_entropy(m(batch[0]), batch[1], reduction="none"))

        held_out = s.loader(TensorDataset(*data.tensors[:2]), batch_size=4 * GLOBAL, evaluation=True)
        result = ddpkit.fit(
            s,
            model,
            opt,
            loader,
            train_step,
            epochs=2,
            progress=False,
            flops=None,
            eval_loader=held_out,
            eval_step=eval_step,
            metrics={"loss": ddpkit.Mean()},
            callbacks=[saver] if root else [],
        )
        return {
            **_outcome(s, model, loader, saver, result),
            "epochs": (result.epochs, loader.position),
            "seen": seen,
            "evals": result.evals,
        }


@pytest.fixture(scope="module")
def unguarded(pool2) -> dict:
    """Two runs without the guard: "clean", whose data never had the bad batch (its samples left out of
    epoch 1 before the run), and "ruined", which trains on it."""
    return {"clean": pool2.run(train_epochs, None, "", 0, "", BAD_1), "ruined": pool2.run(train_epochs, None)}


@pytest.mark.parametrize("save_at", [PER_EPOCH - 3, PER_EPOCH], ids=["mid-epoch", "epoch-end"])
def test_a_rollback_across_an_epoch_boundary_restores_the_epochs_order_and_ends_without_the_batch(
    pool2, unguarded: dict, tmp_path, save_at: int
) -> None:
    """The checkpoint lies in epoch 0 (3 steps before its end, or at its last step), the spike in epoch 1:
    the rollback must go back to epoch 0's order and position, finish epoch 0 (at its end: an empty rest,
    then the epoch's end as before), and read epoch 1 again in its own order with the bad batch left out,
    ending where the run that never had the batch ends; a relaunch from the checkpoint ends bit for bit
    where the first run ended."""
    root = str(tmp_path / "ckpt")
    rolled = pool2.run(train_epochs, "rollback", root, save_at)
    clean, ruined = unguarded["clean"][0], unguarded["ruined"]
    scale = sum(float(v.double().norm() ** 2) for v in clean["weights"].values()) ** 0.5
    far, near = (
        _distance(ruined[0]["weights"], clean["weights"]),
        _distance(rolled[0]["weights"], clean["weights"]),
    )
    print(
        f"from the run without the bad batch (norm {scale:.4g}): unguarded {far:.4g}, rolled back {near:.4g}"
    )
    assert far > 0.1 * scale, "the bad sample should throw an unguarded run far off"
    assert near <= 1e-6 * scale, "the rolled-back run should end where the run that never had the batch ends"
    steps = 2 * PER_EPOCH - 1
    for r in rolled:  # every rank: one spike in epoch 1, one rollback into epoch 0, the same weights
        assert r["events"] == [(PER_EPOCH + BAD_AT + 1, "loss", True)], r["events"]
        assert r["skipped"] == [BAD_1] and r["steps"] == clean["steps"] == steps, (r["skipped"], r["steps"])
        assert all(torch.equal(r["weights"][k], rolled[0]["weights"][k]) for k in r["weights"])
        assert [step for step, _ in r["saved"]] == [save_at]
        # what was trained on, in order: epoch 0 up to the spike's step, back to the checkpoint, the rest
        # of epoch 0 again (none at its end), then epoch 1 in its own order without the bad batch
        replayed = [(0, (k + 1) * GLOBAL) for k in range(save_at, PER_EPOCH)]
        assert r["seen"] == (
            [(0, (k + 1) * GLOBAL) for k in range(PER_EPOCH)]
            + [(1, (k + 1) * GLOBAL) for k in range(BAD_AT + 1)]
            + replayed
            + clean["seen"][PER_EPOCH:]
        ), r["seen"]
    assert rolled[0]["epochs"] == clean["epochs"], (rolled[0]["epochs"], clean["epochs"])
    # one evaluation per epoch's end, as in the run without the batch: the abandoned path's epoch-0 end
    # (after a mid-epoch checkpoint) is dropped, and its repeat (after the epoch-end one) replaces it
    evals, clean_evals = rolled[0]["evals"], clean["evals"]
    assert [e["step"] for e in evals] == [e["step"] for e in clean_evals] == [PER_EPOCH, steps], evals
    assert all(
        math.isclose(e["loss"], c["loss"], rel_tol=1e-6) for e, c in zip(evals, clean_evals, strict=True)
    ), evals
    losses, without = torch.tensor(rolled[0]["losses"]), torch.tensor(clean["losses"])
    assert losses.shape == without.shape == (steps,) and torch.allclose(losses, without, rtol=1e-6, atol=0)
    # relaunched from that checkpoint in epoch 0: the same spike in epoch 1, the same rollback, the same bits
    again = pool2.run(train_epochs, "rollback", "", 0, rolled[0]["saved"][0][1])
    for a, r in zip(again, rolled, strict=True):
        assert a["events"] == r["events"] and a["skipped"] == [BAD_1] and a["steps"] == steps
        assert all(torch.equal(a["weights"][k], r["weights"][k]) for k in r["weights"]), "not bitwise equal"
