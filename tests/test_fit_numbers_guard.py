"""Each `SpikeGuard` option shown by its effect, and the guard in an `s.step` loop: a skipped step that does
not count (`count_skipped=False`) moves neither the session's step counter, nor a loop's step budget, nor
a schedule that follows the counter; a loss that is not finite stops the loop at the step `fit` stops at,
with the same one paragraph, instead of being skipped step after step into a run that ends untrained with
exit code 0; a gradient that overflows under a finite loss is still skipped. The window, warm-up,
threshold and floor are the judge's arithmetic, shown on the judge itself (no process needed)."""

from __future__ import annotations

import math

import pytest
import torch
from test_fit_numbers import GAMMA, GLOBAL, LR, _data, _net
from torch.nn import functional as F

import ddpkit
from ddpkit.errors import DdpkitError
from ddpkit.step.spikes import Judge

pytestmark = pytest.mark.numerics  # .ci/run runs these again under ATEN_CPU_CAPABILITY=default

PLANT = 5  # the planted spike's batch (1-based)


def decide(guard: ddpkit.SpikeGuard, values: list[float]) -> list[bool]:
    """The judge's decision for each value in turn (True: a spike, kept out of the window)."""
    judge = Judge(guard, world=1, report=lambda _: None)
    return [judge.judge(step, {"x": v}) is not None for step, v in enumerate(values, 1)]


def test_window_is_the_number_of_accepted_steps_the_median_is_taken_over() -> None:
    """Four 10s then four 1s: over the last 4 (window=4) the median is 1 and 3 spikes; over all 8 it
    would be 5.5 and 3 would pass."""
    assert decide(ddpkit.SpikeGuard(window=4, warmup=4), [10.0] * 4 + [1.0] * 4 + [3.0])[-1]
    judge = Judge(ddpkit.SpikeGuard(window=4, warmup=4), world=1, report=lambda _: None)
    for step, v in enumerate([10.0] * 4 + [1.0] * 4, 1):
        judge.judge(step, {"x": v})
    assert list(judge.windows["x"]) == [1.0] * 4


def test_warmup_is_the_number_of_accepted_steps_before_any_judgement() -> None:
    assert decide(ddpkit.SpikeGuard(window=10, warmup=3), [1.0, 1.0, 1.0, 50.0]) == [False] * 3 + [True]
    assert decide(ddpkit.SpikeGuard(window=10, warmup=5), [1.0, 1.0, 1.0, 50.0]) == [False] * 4


NOISY = [1.0, 1.1, 0.9] * 3 + [1.0]  # median 1.0, MAD 0.1: a robust standard deviation of 0.148


def test_threshold_is_the_robust_standard_deviations_above_the_median() -> None:
    """1.7 lies 4.7 robust standard deviations above the median, 2.0 lies 6.7 (floor 0: the rule alone)."""
    assert decide(ddpkit.SpikeGuard(window=20, warmup=5, threshold=3.0, floor=0.0), [*NOISY, 1.7])[-1]
    assert not decide(ddpkit.SpikeGuard(window=20, warmup=5, threshold=10.0, floor=0.0), [*NOISY, 2.0])[-1]


def test_floor_is_the_least_rise_judged_a_spike_as_a_fraction_of_the_median() -> None:
    """A flat window (MAD 0): any rise passes the deviation rule, so the floor alone decides."""
    assert decide(ddpkit.SpikeGuard(window=20, warmup=5, floor=0.0), [1.0] * 5 + [1.1])[-1]
    assert not decide(ddpkit.SpikeGuard(window=20, warmup=5, floor=2.0), [1.0] * 5 + [2.5])[-1]


def loop(options: dict, plant: int = 0, nan_at: int = 0, nan_ranks: tuple = (), inf_grad_at: int = 0) -> dict:
    """An `s.step` loop that trains until the session's step counter reaches 7 (a step budget of the
    user's), a schedule that follows that counter (lr = LR * GAMMA**steps). `nan_at`: from that batch on
    the loss of `nan_ranks` is nan; `inf_grad_at`: that batch's gradients overflow under a finite loss."""
    with ddpkit.session(seed=0, verbose=False, log_to=None, spike_guard=ddpkit.SpikeGuard(**options)) as s:
        model = s.model(_net())
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        updates = [0]
        opt.register_step_post_hook(lambda *_: updates.__setitem__(0, updates[0] + 1))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: GAMMA**s.stepper.steps)
        infos, error = [], ""
        try:
            for i, (x, y) in enumerate(s.loader(_data(plant), batch_size=GLOBAL), 1):
                out = model(x)
                if i == inf_grad_at:
                    out.register_hook(lambda g: g * math.inf)
                loss = F.cross_entropy(out, y)
                s.backward(loss * math.nan if nan_at and i >= nan_at and s.rank in nan_ranks else loss)
                infos.append(s.step(opt))
                sched.step()
                if s.stepper.steps == 7:
                    break
        except DdpkitError as exc:
            error = str(exc)
        return {
            "steps": [i.step for i in infos],
            "spikes": [(i.step, i.spike.name, i.spike.counted) for i in infos if i.spike is not None],
            "counter": s.stepper.steps,
            "updates": updates[0],
            "lr": opt.param_groups[0]["lr"],
            "error": error,
        }


GUARD = {"window": 20, "warmup": 2, "floor": 2.0}


@pytest.mark.parametrize("counted", [True, False], ids=["counted", "not-counted"])
def test_count_skipped_decides_whether_a_skip_moves_the_counter_the_budget_and_the_schedule(
    counted: bool, pool2
) -> None:
    """The planted batch 5 is skipped either way (no update). Counted: the counter moves, so the budget of
    7 steps is reached after 7 batches, 6 of them applied, and the schedule advanced 7 times. Not counted:
    the counter stays at 4 for the skip, the loop reads an 8th batch, 7 updates, the schedule 7 times."""
    for r in pool2.run(loop, {**GUARD, "count_skipped": counted}, PLANT):
        assert r["error"] == "" and r["counter"] == 7, r
        assert r["spikes"] == [(5 if counted else 4, "grad_norm", counted)], r["spikes"]
        assert r["steps"] == ([1, 2, 3, 4, 5, 6, 7] if counted else [1, 2, 3, 4, 4, 5, 6, 7]), r["steps"]
        assert r["updates"] == (6 if counted else 7)
        assert math.isclose(r["lr"], LR * GAMMA**7, rel_tol=1e-12), r["lr"]


def fit_nan(nan_at: int, nan_ranks: tuple) -> str:
    """The same loss under `ddpkit.fit` with the default guard: its paragraph."""
    with ddpkit.session(seed=0, verbose=False, log_to=None, spike_guard=ddpkit.SpikeGuard()) as s:
        model = s.model(_net())
        seen = [0]

        def step(m: torch.nn.Module, b: tuple) -> torch.Tensor:
            seen[0] += 1
            loss = F.cross_entropy(m(b[0]), b[1])
            return loss * math.nan if seen[0] >= nan_at and s.rank in nan_ranks else loss

        try:
            ddpkit.fit(
                s,
                model,
                torch.optim.SGD(model.parameters(), lr=LR),
                s.loader(_data(), batch_size=GLOBAL),
                step,
                max_steps=7,
                progress=False,
                flops=None,
            )
        except DdpkitError as exc:
            return str(exc)
        return ""


@pytest.mark.parametrize(
    ("nan_at", "nan_ranks", "said"),
    [(1, (0, 1), "1 on rank(s) [0, 1]"), (3, (1,), "3 on rank(s) [1]")],
    ids=["from-the-first-step", "one-rank-later"],
)
def test_a_loss_that_is_not_finite_stops_an_s_step_loop_where_fit_stops(
    nan_at: int, nan_ranks: tuple, said: str, pool2
) -> None:
    """With SpikeGuard() (the defaults) a nan loss used to be skipped step after step: every rank now stops
    at the step fit stops at, naming the same rank(s), before applying it, with the fix."""
    for r in pool2.run(loop, {}, 0, nan_at, nan_ranks):
        assert f"not finite (nan or inf) at optimizer step {said}" in r["error"], r
        assert "would end untrained" in r["error"] and "Lower the learning rate" in r["error"], r["error"]
        assert r["counter"] == r["updates"] == nan_at - 1 and r["spikes"] == [], r
    for message in pool2.run(fit_nan, nan_at, nan_ranks):
        assert f"at optimizer step {nan_at} (epoch 0) on rank(s) {list(nan_ranks)}" in message, message


def test_a_gradient_that_overflows_under_a_finite_loss_is_still_skipped(pool2) -> None:
    """The stop is for a loss that is not finite; an inf/nan gradient norm under a finite loss stays a
    skip (fp32 and bf16 have no scaler to do it), and training goes on."""
    for r in pool2.run(loop, {}, 0, 0, (), 3):
        assert r["error"] == "" and r["spikes"] == [(3, "grad_norm", True)], r
        assert r["counter"] == 7 and r["updates"] == 6, r
