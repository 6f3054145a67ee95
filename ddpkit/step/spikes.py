"""A loss or gradient spike, caught by every rank in the same step and skipped or rolled back (opt-in).

    with ddpkit.session(spike_guard=ddpkit.SpikeGuard()) as s:   # opt in
        ddpkit.fit(s, model, opt, loader, train_step, max_norm=1.0)
        # an optimizer step whose loss or gradient norm stands far above the last `window` accepted
        # steps is dropped on every rank: no update, its gradients zeroed, one line on rank 0
    # SpikeGuard(remedy="rollback"): under fit, every rank also loads the last checkpoint and leaves the
    # step's samples out of the loader's passes, by global position (`ddpkit.training.fit`)

Why this shape: a rank that decided alone would step while its peers did not, and the replicas would
part for good. So the guard judges only values that are already the same on every rank, bit for bit:
the total gradient norm `s.step` computes from the all-reduced gradients (DDP: each rank's gradients
are identical after the backward's all-reduce, so the norm needs no collective; FSDP and the sharded
step: the one all-reduce of the clip), and, under `ddpkit.fit`, the mean loss that `fit`'s one
all-reduce before the step already agrees (the stop flags and non-finite check travel in the same
tensor). No collective is added per step. In a plain `s.step` loop the loss is each rank's own, so the
guard judges the gradient norm alone there. A loss that is not finite is no spike to skip: `fit` stops at
it, and so does an `s.step` loop whose step has a norm that is not finite and a loss that is not finite on
any rank (one all-reduce of a flag per rank, on that path only; `Stepper._stop_if_loss_not_finite`):
skipped, a loss nan from the first step would skip every step and the run would end untrained.
Without `max_norm` the guard computes the norm itself (`ddpkit.step.spike_norm.grad_norm`: the clip's
norm without the clip, read under DDP from its flat buckets, one kernel per run of gradients lying end to
end there, torch's value but for float rounding; under FSDP or the sharded optimizer step the one scalar
all-reduce a clip costs).

The test is robust to the window's own noise: a value is a spike when it exceeds the window's median by
more than `threshold` robust standard deviations (1.4826 x the median absolute deviation) and by more
than `floor` x the median (so a very smooth window does not turn small wobbles into spikes). Only
accepted steps enter the window, so a spike does not raise the bar for the next one. The first `warmup`
accepted steps are not judged. The window is saved with the stepper's state (`s.save(...,
stepper=s.stepper)`): a run resumed from a checkpoint takes the same decisions.

The cost, per step: one device-to-host copy of the norm (a synchronisation on a GPU; `fit` already waits
for its loss all-reduce at the same place) and, per value, a bisect into a sorted copy of the window (the
median without a sort) and the median absolute deviation only for a value above the floor (a normal step
never needs it). Measured on the small CNN with max_norm (benchmarks/spike_guard_cost.py): ~0.05 ms in
the guard's calls per 12-18 ms step (0.3-0.4%), no collective added; without max_norm the norm it
computes adds ~0.08 ms (0.13 ms in the guard's calls, 1.1-1.2% of the 11.3 ms step: just over the
goal; torch's `get_total_norm`, one kernel per parameter and its own Python, added ~0.3 ms:
docs/fault-tolerance.md has the tables and where the time went).

The rollback is `ddpkit.fit`'s (it owns the loop and the loader's position); this module only marks the
spike (`Spike.rollback`). In an `s.step` loop remedy="rollback" skips, said once. Not covered:
`reproducible="any-world"`'s `s.invariant.step`, and a plain `loss.backward(); opt.step()` loop (no
`s.step`: nothing to hook).
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from ddpkit.errors import problem
from ddpkit.step.spike_norm import grad_norm as grad_norm  # the guard's own norm, read here too

MAD_TO_STD = 1.4826  # the median absolute deviation of a normal sample x this = its standard deviation
REMEDIES = ("skip", "rollback")


@dataclass(frozen=True)
class SpikeGuard:
    """What counts as a spike and what a skipped step costs; pass to `ddpkit.session(spike_guard=...)`.

    `window`: accepted steps the median is taken over. `warmup`: accepted steps before any judgement.
    `threshold`: robust standard deviations above the median. `floor`: the least rise judged a spike, as
    a fraction of the median. `count_skipped`: a skipped step still counts (the session's step counter
    and `fit`'s scheduler advance, so the schedule follows the data); False: neither advances, nor
    `fit`'s `max_steps`, and `fit` reports no loss, log row or evaluation for it (its samples and time go
    into the next counted step's throughput).
    `remedy`: "skip" (drop the step) or "rollback" (under `ddpkit.fit`: every rank loads the last
    checkpoint and leaves the step's samples out from then on, by global position; see `ddpkit.fit`).
    """

    window: int = 100
    warmup: int = 20
    threshold: float = 6.0
    floor: float = 0.5
    count_skipped: bool = True
    remedy: str = "skip"

    def __post_init__(self) -> None:
        if self.window < 2 or not 1 <= self.warmup <= self.window:
            raise problem(
                f"SpikeGuard(window={self.window}, warmup={self.warmup}) cannot judge: the window needs 2 "
                "or more steps and the warm-up 1 to `window` of them",
                "Pass e.g. SpikeGuard(window=100, warmup=20)",
            )
        if not self.threshold > 0 or not self.floor >= 0:
            raise problem(
                f"SpikeGuard(threshold={self.threshold}, floor={self.floor}) would skip every step",
                "Pass a threshold above 0 (robust standard deviations, e.g. 6) and a floor of 0 or more",
            )
        if self.remedy not in REMEDIES:
            raise problem(
                f"SpikeGuard(remedy={self.remedy!r}) is not one of {', '.join(map(repr, REMEDIES))}",
                "Pass remedy='skip' (drop the step) or remedy='rollback' (load the last checkpoint and "
                "leave the step's samples out; under ddpkit.fit)",
            )


@dataclass(frozen=True)
class Spike:
    """One skipped step: which value, how far, against which window; `counted`: the step counter moved;
    `rollback`: `ddpkit.fit` rolls every rank back to the last checkpoint (remedy "rollback")."""

    step: int
    name: str
    value: float
    median: float
    mad: float
    seen: int
    counted: bool
    rollback: bool = False

    def describe(self, world: int, total: int) -> str:
        then = (
            "every rank drops it and rolls back to the last checkpoint"
            if self.rollback
            else f"the step was skipped on all {world} rank(s) (no update, gradients dropped"
        )
        return (
            f"ddpkit: spike at optimizer step {self.step}: {self.name} {self.value:.6g} against a median of "
            f"{self.median:.6g} (MAD {self.mad:.3g}) over the last {self.seen} accepted steps; {then}"
            f"{' (' if self.rollback else '; '}{total} spike(s) so far)"
        )


class Judge:
    """The running windows of one session's stepper and its decisions (the same on every rank)."""

    def __init__(
        self,
        guard: SpikeGuard,
        *,
        world: int,
        report: Callable[[str], None],
        track: Callable[[Mapping[str, float], int], None] | None = None,
    ) -> None:
        self.guard, self.world, self.report, self.track = guard, world, report, track
        self.windows: dict[str, deque[float]] = {}  # the last `window` accepted values, in order
        self.ordered: dict[str, list[float]] = {}  # the same values sorted (the median without a sort)
        self.skipped = 0  # spikes skipped in the run (saved with the stepper's state)
        self.events: list[Spike] = []  # this session's, in order (`s.stepper.spikes.events`)
        self.rolls_back = False  # `ddpkit.fit` acts on the spike (remedy="rollback"): set by `acting`
        self.noted = False  # remedy="rollback" outside fit said once that the step is skipped instead

    def judge(self, step: int, values: Mapping[str, float]) -> Spike | None:
        """The first value that spikes, else None (and every value joins its window). `values` must be
        identical on every rank: the agreed loss and the norm of the all-reduced gradients."""
        g = self.guard
        for name, value in values.items():
            window = self.windows.get(name)
            if not math.isfinite(value):  # fp32/bf16 (fp16's scaler skips these itself)
                med = _median(self.ordered[name]) if window else math.nan
                return self._skip(
                    Spike(
                        step, name, value, med, math.nan, len(window or ()), g.count_skipped, self.rolls_back
                    )
                )
            if window is None or len(window) < g.warmup:
                continue
            med = _median(self.ordered[name])
            if not value - med > g.floor * abs(med):  # below the floor: no spike, whatever the MAD
                continue
            mad = statistics.median(abs(v - med) for v in window)  # only for a value above the floor
            if value - med > g.threshold * MAD_TO_STD * mad:
                return self._skip(
                    Spike(step, name, value, med, mad, len(window), g.count_skipped, self.rolls_back)
                )
        for name, value in values.items():
            self._join(name, value)
        return None

    def _join(self, name: str, value: float) -> None:
        """`value` enters the window (the oldest leaves a full one) and its sorted copy, which keeps the
        median one index away (a bisect, not a sort per step); only finite values enter."""
        window = self.windows.get(name)
        if window is None:  # the first value of this name (not a setdefault: a deque made per step)
            window = self.windows[name] = deque(maxlen=self.guard.window)
            self.ordered[name] = []
        ordered = self.ordered[name]
        if len(window) == window.maxlen:
            del ordered[bisect.bisect_left(ordered, window[0])]
        window.append(value)
        bisect.insort(ordered, value)

    def _skip(self, spike: Spike) -> Spike:
        self.skipped += 1
        self.events.append(spike)
        self.report(spike.describe(self.world, self.skipped))
        if self.guard.remedy == "rollback" and not self.rolls_back and not self.noted:
            self.noted = True
            self.report(
                "ddpkit: SpikeGuard(remedy='rollback') rolls back under ddpkit.fit only (it owns "
                "the loop and the data position); this loop's spiking steps are skipped instead"
            )
        if self.track is not None:
            self.track(
                {
                    f"spike/{spike.name}": spike.value,
                    "spike/median": spike.median,
                    "spike/skipped": float(self.skipped),
                },
                spike.step,
            )
        return spike

    @contextmanager
    def acting(self, *, rolls_back: bool) -> Iterator[None]:
        """While a loop that acts on the spikes runs (`ddpkit.fit` with remedy="rollback": its spikes are
        marked `Spike.rollback`); outside it a rollback spike is skipped, said once."""
        self.rolls_back = rolls_back
        try:
            yield
        finally:
            self.rolls_back = False

    def rolled_back(self) -> None:
        """The loop loaded the last checkpoint for a spike: the window and count are the checkpoint's, so
        this spike is counted again on top of them (the checkpoint's count, and this spike)."""
        self.skipped += 1

    def state_dict(self) -> dict:
        return {"windows": {k: list(v) for k, v in self.windows.items()}, "skipped": self.skipped}

    def load_state_dict(self, state: Mapping | None) -> None:
        if not state:
            return
        self.windows, self.ordered = {}, {}
        for name, values in state["windows"].items():
            for v in values:
                self._join(name, float(v))
        self.skipped = int(state.get("skipped", 0))


def _median(ordered: list[float]) -> float:
    """`statistics.median` of an already sorted list (the same arithmetic, so the same bits)."""
    n = len(ordered)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def judge_for(
    guard: SpikeGuard | None,
    *,
    world: int,
    report: Callable[[str], None],
    track: Callable[[Mapping[str, float], int], None],
) -> Judge | None:
    """The session's judge for `spike_guard=` (None: no guard); anything but a `SpikeGuard` is refused."""
    if guard is None:
        return None
    if not isinstance(guard, SpikeGuard):
        raise problem(
            f"spike_guard={guard!r} is not a ddpkit.SpikeGuard",
            "Pass spike_guard=ddpkit.SpikeGuard() (its window and thresholds as options), or leave it out",
        )
    return Judge(guard, world=world, report=report, track=track)
