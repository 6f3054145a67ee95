"""Every number `ddpkit.fit` reports, after an out-of-memory split, a spike-guard skip (counted and not), a
restart from a checkpoint and a spike rollback, against what a user computes by hand: the same global
batches through the same model with plain PyTorch in one process (`by_hand`), and the step, sample and
schedule arithmetic of the case.

One table row per case; each runs `fit` once on two gloo ranks (a tiny ReLU net, 8 samples per step) and
returns what a user sees: the `FitResult`, the plain progress lines (stdout is not a terminal), the log
file's rows (`log=`), a tracker of one's own (`log_to=`), the spike guard's window of judged losses, the
session's step counter, the optimizer steps taken and the learning rate. The numbers checked:

- loss: FitResult.losses, the progress line, the log rows, the tracker and the guard's window, each the
  mean over the global batch (after a split the mean over its parts, never their sum);
- lr: after step k the schedule's value after its k-th step (the lr the next step uses);
- step: 1..n in the log rows and the progress line (this call's count), the session's count at the tracker;
- skipped steps, evaluations (their step and the eval loss of the weights at it), epochs;
- samples per step: throughput x step time of a row (the rates' own arithmetic; the seconds themselves
  are not deterministic) is the global batch, and twice it for the step after a skip that does not count.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from recording import Recorder
from test_oom import _Planted
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.observe.metrics import Mean

pytestmark = pytest.mark.numerics

GLOBAL, BATCHES, LR, GAMMA = (
    8,
    10,
    0.1,
    0.8,
)  # global batch, batches in the data, the schedule's lr0 * GAMMA**k
EVAL_EVERY = 4
REL = 1e-5  # DDP's two half-batch means against one process's mean over the batch, a few steps on
LINE = re.compile(r"^fit: step (\d+)(?:/\d+)?(?: \(\d+%\))?, epoch (\d+), loss ([^,]+),")


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def _data(plant: int = 0) -> TensorDataset:
    """BATCHES global batches in order (the loader does not shuffle); `plant`: batch `plant` (1-based) has
    one sample scaled by 1e4, a spike in both the loss and the gradient norm."""
    g = torch.Generator().manual_seed(3)
    x, y = (
        torch.randn(BATCHES * GLOBAL, 6, generator=g),
        torch.randint(0, 3, (BATCHES * GLOBAL,), generator=g),
    )
    if plant:
        x[(plant - 1) * GLOBAL] *= 1e4
    return TensorDataset(x, y)


def _eval_data() -> TensorDataset:
    g = torch.Generator().manual_seed(4)
    return TensorDataset(torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g))


def _eval_step(model: nn.Module, batch: tuple, metrics: dict) -> None:
    metrics["loss"].update(F.cross_entropy(model(batch[0]), batch[1], reduction="none"))


@dataclass(frozen=True)
class Case:
    """One way of running `fit` and what a user computes for it by hand."""

    max_steps: int = 7
    oom: int = 0  # rank 1 runs out of memory in this optimizer step (1-based): the step re-runs in 2 parts
    plant: int = 0  # the global batch (1-based) with the planted spike
    guard: dict = field(default_factory=dict)  # SpikeGuard's options beyond GUARD
    save_at: tuple[int, ...] = ()  # a callback saves model, optimizer, stepper, loader and scheduler here
    # by hand:
    order: tuple[int, ...] = tuple(range(7))  # the global batches (0-based) the final path steps on
    skip: tuple[int, ...] = ()  # of them, those whose step applies no update (the guard skips them)
    counted: bool = True  # a skip counts as a step (SpikeGuard(count_skipped=))
    skipped: int = 0  # FitResult.skipped_steps
    updates: int = 7  # optimizer.step() calls (a rollback replays some)
    parts: int = 1  # the split in force at the end
    doubled: tuple[int, ...] = ()  # steps whose row holds two batches' samples (after an uncounted skip)


GUARD = {"window": 20, "warmup": 2, "floor": 2.0}  # a floor of 3x the median: no false spike in 7 steps
CASES = {
    "plain": Case(),
    "split": Case(oom=3, parts=2),
    "skip": Case(plant=5, skip=(4,), skipped=1, updates=6),
    "skip-uncounted": Case(
        plant=5,
        guard={"count_skipped": False},
        order=tuple(range(8)),
        skip=(4,),
        counted=False,
        skipped=1,
        doubled=(5,),
    ),
    "rollback": Case(
        plant=5,
        guard={"remedy": "rollback"},
        save_at=(3, 6),
        order=(0, 1, 2, 3, 5, 6, 7),
        skipped=1,
        updates=8,
    ),
}


class _Saver(ddpkit.Callback):
    def __init__(self, root: str, things: dict, at: tuple[int, ...]) -> None:
        self.root, self.things, self.at = root, things, at

    def on_step_end(self, state: ddpkit.FitState) -> None:
        if state.step in self.at:
            state.s.save(self.root, **self.things)


def run(case: Case, tmp: str, start: str = "", stop: str = "") -> dict:
    """`fit` on every rank as `case` says; `start`: resume from that checkpoint; `stop`: save there at the
    end. What rank 0 shows a user, and every rank's FitResult."""
    rec, out = Recorder(), io.StringIO()
    guard = ddpkit.SpikeGuard(**{**GUARD, **case.guard})
    auto = "auto" if case.oom or start or stop else None
    with (
        contextlib.redirect_stdout(out),
        ddpkit.session(seed=0, verbose=False, log_to=rec, spike_guard=guard, micro_batch=auto) as s,
    ):
        model = s.model(_net())
        init = {k: v.clone() for k, v in ddpkit.unwrap(model).state_dict().items()}
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        updates = [0]
        opt.register_step_post_hook(lambda *_: updates.__setitem__(0, updates[0] + 1))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: GAMMA**k)
        loader = s.loader(_data(case.plant), batch_size=GLOBAL)
        things = {
            "model": model,
            "optimizer": opt,
            "stepper": s.stepper,
            "loader": loader,
            "scheduler": sched,
        }
        if start:
            s.load(start, **things)
        planted = _Planted(rank=1, above=GLOBAL // 4, from_step=case.oom - 1, at=0, where="forward")
        log = Path(tmp) / "log.jsonl"
        result = ddpkit.fit(
            s,
            model,
            opt,
            loader,
            (lambda m, b: planted(s, m, b)) if case.oom else (lambda m, b: F.cross_entropy(m(b[0]), b[1])),
            max_steps=case.max_steps,
            eval_loader=s.loader(_eval_data(), batch_size=16, evaluation=True),
            eval_step=_eval_step,
            metrics={"loss": Mean()},
            eval_every=EVAL_EVERY,
            scheduler=sched,
            callbacks=[_Saver(str(Path(tmp) / "ckpt"), things, case.save_at)],
            log=str(log),
            track_every=1,
            flops=None,
        )
        if stop:
            s.save(stop, **things)
        rows = [json.loads(line) for line in log.read_text().splitlines()] if s.rank == 0 else []
        return {
            "init": init,
            "result": result,
            "lines": [line for line in out.getvalue().splitlines() if line.startswith("fit: ")],
            "rows": [r for r in rows if r["phase"] == "train"],
            "tracked": [(step, v) for step, v in rec.seen if "loss" in v],
            "window": list(s.stepper.spikes.windows.get("loss", ())),
            "session_steps": s.stepper.steps,
            "updates": updates[0],
            "lr": opt.param_groups[0]["lr"],
            "parts": s.stepper.oom.parts if s.stepper.oom else 1,
        }


def by_hand(init: dict, case: Case, steps: int) -> dict:
    """A user's plain PyTorch in one process: each global batch of `case.order` in turn, its mean loss, an
    SGD update unless the guard skips it, the schedule stepped for every counted step; the eval loss of the
    weights after every EVAL_EVERY-th and the last step."""
    model = _net()
    model.load_state_dict(init)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: GAMMA**k)
    (x, y), (ex, ey) = _data(case.plant).tensors, _eval_data().tensors
    losses, lrs, evals, accepted = [], [], {}, []
    for b in case.order:
        opt.zero_grad()
        loss = F.cross_entropy(model(x[b * GLOBAL : (b + 1) * GLOBAL]), y[b * GLOBAL : (b + 1) * GLOBAL])
        if b not in case.skip:
            loss.backward()
            opt.step()
            accepted.append(loss.item())
        if b in case.skip and not case.counted:
            continue
        sched.step()
        losses.append(loss.item())
        lrs.append(opt.param_groups[0]["lr"])
        if len(losses) % EVAL_EVERY == 0 or len(losses) == steps:
            with torch.no_grad():
                evals[len(losses)] = F.cross_entropy(model(ex), ey).item()
        if len(losses) == steps:
            break
    return {"losses": losses, "lrs": lrs, "evals": evals, "accepted": accepted}


def _close(got: float, want: float, rel: float = REL) -> bool:
    return math.isclose(got, want, rel_tol=rel, abs_tol=1e-7)


def check_numbers(got: list[dict], case: Case, hand: dict, first: int = 0, offset: int = 0) -> None:
    """Every channel against the hand's numbers; `first`: the hand's steps before this call (a resume),
    `offset`: the session's steps before this call (the tracker's step axis)."""
    losses, lrs = hand["losses"][first:], hand["lrs"][first:]
    n = len(losses)
    r0 = got[0]
    for r in got:  # every rank returns the same agreed numbers
        res = r["result"]
        assert res.losses == r0["result"].losses and res.steps == n, (res.steps, n)
        assert all(_close(a, b) for a, b in zip(res.losses, losses, strict=True)), (res.losses, losses)
        assert (res.epochs, res.stop_reason, res.skipped_steps) == (1, None, case.skipped), res
        assert [e["step"] for e in res.evals] == sorted({*range(EVAL_EVERY, n + 1, EVAL_EVERY), n})
        for e in res.evals:
            assert _close(e["loss"], hand["evals"][first + e["step"]]), (e, hand["evals"])
        assert r["session_steps"] == offset + n and r["updates"] == case.updates, (
            r["session_steps"],
            r["updates"],
        )
        assert _close(r["lr"], LR * GAMMA ** (first + n)) and r["parts"] == case.parts
    rows, tracked, lines = r0["rows"], r0["tracked"], r0["lines"]
    rollback = bool(case.guard.get("remedy"))  # the replayed steps are reported again
    if not rollback:
        assert [row["step"] for row in rows] == list(range(1, n + 1)), [row["step"] for row in rows]
        assert [step for step, _ in tracked] == list(range(offset + 1, offset + n + 1)), tracked
        assert [int(LINE.match(line)[1]) for line in lines] == list(range(1, n + 1)), lines
    last_row = {row["step"]: row for row in rows}  # after a rollback, the final path's (written last)
    last_tracked = {step - offset: v for step, v in tracked}
    assert sorted(last_row) == sorted(last_tracked) == list(range(1, n + 1))
    for k in range(1, n + 1):
        row, values = last_row[k], last_tracked[k]
        for where in (row, values):
            assert _close(where["loss"], losses[k - 1]) and _close(where["lr"], lrs[k - 1]), (k, where)
            samples = where["throughput"] * where["step_time"]  # samples over all ranks per step
            want = GLOBAL * (2 if k in case.doubled else 1)
            assert math.isclose(samples, want, rel_tol=1e-9), (k, samples, want)
        assert row["epoch"] == 0
    for line in lines:  # 4 significant digits
        step, epoch, loss = LINE.match(line).groups()
        assert int(epoch) == 0 and _close(float(loss), losses[int(step) - 1], 1e-3), (line, losses)
    window, accepted = r0["window"], hand["accepted"]  # the losses the guard judged and let in
    assert all(_close(a, b) for a, b in zip(window, accepted, strict=True)), (window, accepted)


@pytest.mark.parametrize("name", list(CASES))
def test_every_number_fit_reports(name: str, pool2, tmp_path: Path) -> None:
    case = CASES[name]
    got = pool2.run(run, case, str(tmp_path), timeout=120)
    check_numbers(got, case, by_hand(got[0]["init"], case, case.max_steps))


def test_after_a_split_every_channel_sees_the_mean_over_the_parts(pool2, tmp_path: Path) -> None:
    """The same batches unsplit and split at step 3 (2 parts from then on): the loss of every step, as
    FitResult, the log, the tracker, the progress line and the guard's window hold it, within float
    tolerance (a sum over the parts would be twice it)."""
    plain = pool2.run(run, CASES["plain"], str(tmp_path / "plain"), timeout=120)[0]
    split = pool2.run(run, CASES["split"], str(tmp_path / "split"), timeout=120)[0]
    assert split["parts"] == 2 and plain["parts"] == 1
    pairs = [
        (split["result"].losses, plain["result"].losses),
        ([r["loss"] for r in split["rows"]], [r["loss"] for r in plain["rows"]]),
        ([v["loss"] for _, v in split["tracked"]], [v["loss"] for _, v in plain["tracked"]]),
        (split["window"], plain["window"]),
    ]
    for a, b in pairs:
        assert len(a) == len(b) == 7 and all(_close(x, y) for x, y in zip(a, b, strict=True)), (a, b)
    assert [LINE.match(x)[3] for x in split["lines"]] == [LINE.match(x)[3] for x in plain["lines"]]


def test_a_resume_reports_the_numbers_of_the_run_it_continues(pool2, tmp_path: Path) -> None:
    """Split at step 2, saved after 3 (the split with it), resumed for 4 more: the resumed call's losses,
    evaluations and schedule are steps 4-7 of the uninterrupted run by hand, each step's loss the mean
    over the 2 parts from its first step on, the tracker's step axis continues at 4, the call's own rows
    and progress line count 1-4."""
    ckpt = str(tmp_path / "restart")
    before = Case(max_steps=3, oom=2, parts=2, updates=3)
    got = pool2.run(run, before, str(tmp_path / "a"), "", ckpt, timeout=120)
    check_numbers(got, before, by_hand(got[0]["init"], before, 3))
    after = Case(max_steps=4, parts=2, updates=4)
    got = pool2.run(run, after, str(tmp_path / "b"), ckpt, timeout=120)  # its init: the same seed's
    check_numbers(got, after, by_hand(got[0]["init"], CASES["plain"], 7), first=3, offset=3)
