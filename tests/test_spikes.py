"""The spike guard on real gloo ranks: a planted bad batch ruins the weights without it and is skipped
with it (ending where a run that never saw the batch ends), every rank skips the same step, a spike in
one rank's loss alone is still skipped by all, and a resume from a checkpoint taken before the spike
takes the same decisions and ends bit for bit where the uninterrupted run ends."""

from __future__ import annotations

import gc
import math
import weakref
from pathlib import Path

import pytest
import torch
from recording import Recorder
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.errors import DdpkitError

pytestmark = pytest.mark.numerics  # .ci/run runs these again under ATEN_CPU_CAPABILITY=default

STEPS, GLOBAL, PLANT = 20, 16, 12  # optimizer steps, global batch, the step whose batch is bad (1-based)
GUARD = ddpkit.SpikeGuard(window=20, warmup=5) if hasattr(ddpkit, "SpikeGuard") else None


def _data(planted: bool, removed: bool = False) -> TensorDataset:
    """STEPS global batches in order; `planted`: one sample of batch PLANT scaled by 1e4; `removed`: that
    whole batch left out (the run that never had it)."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(STEPS * GLOBAL, 10, generator=g), torch.randint(0, 3, (STEPS * GLOBAL,), generator=g)
    first = (PLANT - 1) * GLOBAL
    if planted:
        x[first] *= 1e4
    if removed:
        keep = torch.cat([torch.arange(first), torch.arange(first + GLOBAL, STEPS * GLOBAL)])
        x, y = x[keep], y[keep]
    return TensorDataset(x, y)


def train(
    planted: bool,
    removed: bool,
    guard: bool,
    ckpt: str = "",
    stop: int = 0,
    lift: int = 0,
    options: dict | None = None,
) -> dict:
    """One epoch under `fit` on every rank. `ckpt` + `stop`: save after `stop` steps and return;
    `ckpt` alone: resume from it. `lift`: at that step, rank 0's loss gets +1e3 (no gradient: only
    its own loss spikes, the agreed mean with it). `options`: more of the session's (accumulation=2,
    strategy="fsdp")."""
    rec = Recorder()
    with ddpkit.session(
        seed=0, verbose=False, log_to=rec, spike_guard=GUARD if guard else None, **(options or {})
    ) as s:
        model = s.model(nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3)))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        loader = s.loader(_data(planted, removed), batch_size=GLOBAL)
        things = {"model": model, "optimizer": opt, "stepper": s.stepper, "loader": loader}
        if ckpt and not stop:
            s.load(ckpt, **things)
        calls = [s.stepper.steps]

        def train_step(m: nn.Module, batch: tuple) -> torch.Tensor:
            calls[0] += 1
            loss = F.cross_entropy(m(batch[0]), batch[1])
            return loss + 1e3 if calls[0] == lift and s.rank == 0 else loss

        ddpkit.fit(
            s,
            model,
            opt,
            loader,
            train_step,
            epochs=1,
            max_steps=stop or None,
            progress=False,
            flops=None,
            track_every=1000,
        )
        if stop:
            s.save(ckpt, **things)
        judge = s.stepper.spikes
        return {
            "weights": _full(model),
            "events": [(e.step, e.name) for e in judge.events] if judge is not None else [],
            "steps": s.stepper.steps,
            "tracked": [(step, sorted(v)) for step, v in rec.seen if any(k.startswith("spike/") for k in v)],
        }


def train_loop(planted: bool) -> dict:
    """The `s.step` loop, no `max_norm`: the guard sees no agreed loss and judges the gradient norm, which
    it computes itself (over DDP's flat buckets); `norms`: that norm and torch's `get_total_norm` of the
    same all-reduced gradients, per step."""
    with ddpkit.session(seed=0, verbose=False, log_to=None, spike_guard=GUARD) as s:
        model = s.model(nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3)))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        infos, torch_norms = [], []
        for x, y in s.loader(_data(planted), batch_size=GLOBAL):
            s.backward(F.cross_entropy(model(x), y))
            torch_norms.append(float(nn.utils.get_total_norm([p.grad for p in model.parameters()])))
            infos.append(s.step(opt))
        return {
            "weights": {k: v.clone() for k, v in ddpkit.unwrap(model).state_dict().items()},
            "events": [(e.step, e.name) for e in s.stepper.spikes.events],
            "skipped": [i.step for i in infos if i.skipped],
            "norms": [(float(i.grad_norm), n) for i, n in zip(infos, torch_norms, strict=True)],
        }


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole weights (FSDP's shards gathered: `full_tensor` is a collective, every rank calls it)."""
    state = ddpkit.unwrap(model).state_dict()
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in state.items()}


def _distance(a: dict, b: dict) -> float:
    return sum(float((a[k] - b[k]).double().norm() ** 2) for k in a) ** 0.5


def test_a_planted_bad_batch_ruins_the_weights_unless_every_rank_skips_it(pool2) -> None:
    clean = pool2.run(train, False, True, False)  # the data without the bad batch, no guard needed
    ruined = pool2.run(train, True, False, False)
    guarded = pool2.run(train, True, False, True)
    scale = sum(float(v.double().norm() ** 2) for v in clean[0]["weights"].values()) ** 0.5
    far, near = (
        _distance(ruined[0]["weights"], clean[0]["weights"]),
        _distance(guarded[0]["weights"], clean[0]["weights"]),
    )
    print(
        f"weights' distance from the run without the bad batch (norm {scale:.4g}): unguarded {far:.4g}, "
        f"guarded {near:.4g}"
    )
    assert far > scale, "the planted sample should wreck an unguarded run"
    assert near <= 1e-6 * scale, "the guarded run should end where the run that never saw the batch ends"
    for r in guarded:  # every rank: the same single decision, the same weights
        assert r["events"] == [(PLANT, "loss")] and r["steps"] == STEPS
        assert all(torch.equal(r["weights"][k], guarded[0]["weights"][k]) for k in r["weights"])
    assert guarded[0]["tracked"] == [(PLANT, ["spike/loss", "spike/median", "spike/skipped"])]
    assert clean[0]["steps"] == STEPS - 1 and ruined[0]["events"] == []


def test_a_spike_in_one_ranks_loss_is_skipped_by_every_rank(pool2) -> None:
    """Only rank 0's loss spikes (a constant: no gradient); the agreed loss carries it to rank 1."""
    runs = pool2.run(train, False, False, True, "", 0, PLANT)
    for r in runs:
        assert r["events"] == [(PLANT, "loss")], r["events"]
        assert all(torch.equal(r["weights"][k], runs[0]["weights"][k]) for k in r["weights"]), (
            "the ranks' weights parted: one rank decided alone"
        )


def test_the_step_loop_judges_the_gradient_norm_alone(pool2) -> None:
    clean = pool2.run(train, False, True, False)
    runs = pool2.run(train_loop, True)
    for r in runs:
        assert r["events"] == [(PLANT, "grad_norm")] and r["skipped"] == [PLANT], r["events"]
        # the guard's norm (one kernel per bucket) is torch's over every gradient but for float rounding,
        # and the same bits on every rank
        assert r["norms"] == runs[0]["norms"], "the ranks judged different norms"
        assert all(math.isclose(mine, theirs, rel_tol=1e-5) for mine, theirs in r["norms"]), r["norms"]
    scale = sum(float(v.double().norm() ** 2) for v in clean[0]["weights"].values()) ** 0.5
    assert _distance(runs[0]["weights"], clean[0]["weights"]) <= 1e-6 * scale


def test_a_resume_from_before_the_spike_decides_the_same_and_ends_bitwise_equal(
    pool2, tmp_path: Path
) -> None:
    ckpt = str(tmp_path / "ckpt")
    whole = pool2.run(train, True, False, True)
    pool2.run(train, True, False, True, ckpt, PLANT - 4)
    resumed = pool2.run(train, True, False, True, ckpt)
    for w, r in zip(whole, resumed, strict=True):
        assert r["events"] == [(PLANT, "loss")] and r["steps"] == w["steps"] == STEPS
        assert all(torch.equal(r["weights"][k], w["weights"][k]) for k in w["weights"]), "not bitwise equal"


@pytest.mark.parametrize("options", [{"accumulation": 2}, {"strategy": "fsdp"}], ids=["accumulation", "fsdp"])
def test_the_planted_batch_is_skipped_under_accumulation_and_fsdp(pool2, options: dict) -> None:
    """Accumulation: the spike lies in one micro-batch and the whole optimizer step goes. FSDP: the norm is
    the clip's one all-reduce over the shards, the loss fit's; the weights gathered for the comparison."""
    clean = pool2.run(train, False, True, False, "", 0, 0, options)
    guarded = pool2.run(train, True, False, True, "", 0, 0, options)
    scale = sum(float(v.double().norm() ** 2) for v in clean[0]["weights"].values()) ** 0.5
    assert _distance(guarded[0]["weights"], clean[0]["weights"]) <= 1e-6 * scale
    for r in guarded:
        assert r["events"] == [(PLANT, "loss")] and r["steps"] == STEPS, r["events"]
        assert all(torch.equal(r["weights"][k], guarded[0]["weights"][k]) for k in r["weights"])


def count_collectives(guard: bool) -> dict[str, int]:
    """The gloo collectives of a whole `fit` (8 steps, max_norm as usual), counted by torch's profiler
    (without kineto: the same record of every op, collectives included, without kineto's ~2 s start)."""
    from torch.autograd.profiler import profile

    with ddpkit.session(seed=0, verbose=False, log_to=None, spike_guard=GUARD if guard else None) as s:
        model = s.model(nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3)))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        loader = s.loader(_data(False), batch_size=GLOBAL)

        def train_step(m: nn.Module, batch: tuple) -> torch.Tensor:
            return F.cross_entropy(m(batch[0]), batch[1])

        with profile(use_kineto=False) as prof:
            ddpkit.fit(
                s, model, opt, loader, train_step, max_steps=8, max_norm=1.0, progress=False, flops=None
            )
        counts: dict[str, int] = {}
        for event in prof.function_events:
            if event.name.startswith("gloo:"):
                counts[event.name] = counts.get(event.name, 0) + 1
        return counts


def test_the_guard_adds_no_collective_per_step(pool2) -> None:
    """Its decision is taken from values every rank already agrees on (the clip's norm of all-reduced
    gradients, fit's agreed loss): no barrier, no flag reduced per step, unlike a guard that votes."""
    without, with_guard = pool2.run(count_collectives, False), pool2.run(count_collectives, True)
    assert without[0].get("gloo:all_reduce", 0) >= 8, without  # the profiler sees the steps' all-reduces
    for a, b in zip(without, with_guard, strict=True):
        assert b == a, f"the guard changed the collectives of 8 steps: {a} without it, {b} with it"


def test_a_guard_that_could_never_judge_is_refused() -> None:
    with pytest.raises(DdpkitError, match="window"):
        ddpkit.SpikeGuard(window=10, warmup=20)
    with pytest.raises(DdpkitError, match="remedy='rollback'"):
        ddpkit.SpikeGuard(remedy="undo")
    with pytest.raises(DdpkitError, match="SpikeGuard"), ddpkit.session(spike_guard=0.5, log_to=None):  # type: ignore[arg-type]
        pass


@pytest.mark.parametrize("floor", [0.0, 0.5])
def test_the_judge_decides_by_the_median_and_mad_rule_across_a_save(floor: float) -> None:
    """The judge keeps its windows sorted and computes the MAD only above the floor (its per-step cost):
    its decisions and reported medians must be those of the rule computed from scratch every step, also
    after its state is saved and loaded into a fresh judge mid-way."""
    import statistics
    from collections import deque

    from ddpkit.step.spikes import MAD_TO_STD, Judge

    guard = ddpkit.SpikeGuard(window=16, warmup=4, threshold=3.0, floor=floor)
    g = torch.Generator().manual_seed(0)
    values = (1.0 + 0.05 * torch.randn(400, 2, generator=g, dtype=torch.float64)).tolist()
    for i in range(7, 400, 23):
        values[i][i % 2] *= 1.0 + 2.0 * (i % 3)  # spikes in either value, some below the floor of 0.5
    judge, window = Judge(guard, world=2, report=lambda _: None), {n: deque(maxlen=16) for n in ("a", "b")}
    decisions, expected = [], []
    for step, (a, b) in enumerate(values, 1):
        if step == 200:
            judge2 = Judge(guard, world=2, report=lambda _: None)
            judge2.load_state_dict(judge.state_dict())
            judge = judge2
        spike = judge.judge(step, {"a": a, "b": b})
        decisions.append(None if spike is None else (spike.name, spike.median))
        want = None
        for name, v in (("a", a), ("b", b)):
            w = window[name]
            if len(w) >= guard.warmup:
                med = statistics.median(w)
                mad = statistics.median(abs(x - med) for x in w)
                if v - med > max(guard.threshold * MAD_TO_STD * mad, guard.floor * abs(med)):
                    want = (name, med)
                    break
        if want is None:
            window["a"].append(a)
            window["b"].append(b)
        expected.append(want)
    assert decisions == expected
    assert 5 <= sum(d is not None for d in decisions) < 40, decisions  # the planted spikes are judged


def test_the_guards_own_norm_reads_each_run_of_bucket_views_as_one_tensor_and_holds_no_model() -> None:
    """Without max_norm the guard computes the norm itself; gradients that are views into one flat buffer
    (DDP's buckets: shuffled order, a gap between runs) are read as one tensor per run: the value must be
    torch's over the gradients, also after a gradient is replaced by a tensor of its own, and the
    buffer must be let go with the model (the guard keeps its views between steps)."""
    from ddpkit.step import spikes

    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3))
    params = list(model.parameters())
    model(torch.randn(4, 10)).sum().backward()
    assert spikes.grad_norm(params) == nn.utils.get_total_norm([p.grad for p in params])  # no views: torch's
    bucket, at = torch.zeros(sum(p.numel() for p in params) + 7), 0
    for i, p in enumerate([params[2], params[0], params[3], params[1]]):
        at += 7 if i == 2 else 0  # two runs: 2 + 0, then 3 + 1
        view = bucket[at : at + p.numel()].view_as(p)
        view.copy_(p.grad)
        p.grad, at = view, at + p.numel()
    for change in ("", "a gradient grows", "one is replaced"):
        if change == "a gradient grows":
            params[1].grad.mul_(1e3)  # in the last run's last gradient
        elif change == "one is replaced":
            params[0].grad = params[0].grad.clone()
        want = float(nn.utils.get_total_norm([p.grad for p in params]))
        assert math.isclose(float(spikes.grad_norm(params)), want, rel_tol=1e-6), change
    held = weakref.ref(bucket)
    del bucket, view, params, p, model
    gc.collect()
    assert held() is None, "the guard keeps a freed model's gradient buffer alive"
