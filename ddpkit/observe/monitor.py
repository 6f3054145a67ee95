"""What a training loop reports about its steps besides the loss: throughput, MFU, every rank's anatomy.

`StepMonitor` bundles the pieces for `fit` (or any loop that marks its phases):

    monitor.anatomy.mark("data") ...            the phases (ddpkit.observe.anatomy), on every rank
    loss = monitor.counting(run, batch)         the first micro-batch runs under the FLOP counter
    monitor.after_step(step)                    every `every` steps: one all_gather, the slow-rank check
    monitor.scalars(step_s)                     TFLOP/s, MFU, per-rank medians, for s.log / the log rows
    monitor.detail(step_s)                      "3.1 TFLOP/s, MFU 41%" for the progress line

MFU's peak is looked up (GPU) or measured (CPU, cached per machine) on rank 0 only, which alone shows
and logs it (`ddpkit.observe.flops`).

A loop written by hand gets the same through `s.log` (`ddpkit.StepMonitor.of(s)`; its step time is then
this rank's median step from the anatomy that `s.backward`/`s.step` mark):

    monitor = ddpkit.StepMonitor.of(s)                  # after s.model; flops="count" by default
    for step, (x, y) in enumerate(train, 1):
        with s.accumulate(model):
            s.backward(monitor.counting(lambda b: F.cross_entropy(model(b[0]), b[1]), (x, y)))
        s.step(opt)
        monitor.after_step(step)                        # every rank: every 10 steps one all_gather
        if step % 10 == 0:
            s.log({"loss": ..., **monitor.scalars()}, step=step)   # TFLOP/s, MFU, per-rank medians
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from ddpkit.errors import problem
from ddpkit.observe.anatomy import StepAnatomy
from ddpkit.observe.flops import Peak, Utilisation, count_flops, device_peak, utilisation
from ddpkit.observe.slowrank import RankView, SlowRankDetector
from ddpkit.parallel.collectives import Ranks

T = TypeVar("T")


class _Named(Protocol):
    @property
    def name(self) -> str: ...


class Monitored(Ranks, Protocol):
    """What `StepMonitor.of` reads of a session (a `ddpkit.Session` is one): its ranks, the precision's
    name, the loader micro-batches per optimizer step, whether it is rank 0, the anatomy `s.backward` and
    `s.step` mark, and its output. A protocol, so the observe wing never imports the facade."""

    @property
    def precision(self) -> _Named: ...
    @property
    def accumulation(self) -> int: ...
    @property
    def is_main(self) -> bool: ...
    @property
    def anatomy(self) -> StepAnatomy: ...
    def print(self, *args: Any) -> None: ...


class StepMonitor:
    """One per loop: the anatomy of this rank's steps, the ranks' table, FLOPs and the peak."""

    def __init__(
        self,
        ranks: Ranks,
        *,
        precision: str = "32",
        accumulation: int = 1,
        flops: float | str | None = "count",
        every: int = 10,
        main: bool = True,
        report: Callable[[str], Any] = print,
        detector: SlowRankDetector | None = None,
        anatomy: StepAnatomy | None = None,
    ) -> None:
        if not (flops is None or flops == "count" or (isinstance(flops, (int, float)) and flops > 0)):
            raise problem(
                f"flops={flops!r} is not 'count', a positive number or None",
                "Pass 'count' (the default: counted on the first micro-batch), the model FLOPs of one "
                "optimizer step on one device, or None to leave FLOPs and MFU out",
            )
        self.anatomy = anatomy or StepAnatomy()
        self.view = RankView(ranks, self.anatomy, every=every, report=report, detector=detector)
        self.accumulation = accumulation
        self.flops_per_step: float | None = None if flops in (None, "count") else float(flops)
        self._count = flops == "count"
        self.main = main
        self.peak: Peak | None = None
        if main and flops is not None:
            self.peak = device_peak(ranks.device, precision)
        self._pending: dict[str, float] = {}

    @classmethod
    def of(cls, s: Monitored, *, flops: float | str | None = "count", every: int = 10) -> StepMonitor:
        """The monitor of a session `s` (its ranks, precision, accumulation, output and the anatomy its
        `s.backward`/`s.step` mark), for a loop written by hand; `fit` builds the same."""
        return cls(
            s,
            precision=s.precision.name,
            accumulation=s.accumulation,
            flops=flops,
            every=every,
            main=s.is_main,
            report=s.print,
            anatomy=s.anatomy,
        )

    def counting(self, run: Callable[[Any], T], arg: Any) -> T:
        """`run(arg)`; the first time (flops="count"), under the FLOP counter: per step = x accumulation."""
        if not self._count:
            return run(arg)
        self._count = False
        out: list[T] = []
        flops = count_flops(lambda: out.append(run(arg)))
        self.flops_per_step = float(flops * self.accumulation) if flops > 0 else None
        return out[0]

    def after_step(self, step: int) -> None:
        """After each optimizer step, on every rank (every `every` steps it is a collective)."""
        scalars = self.view.after_step(step)
        if scalars is not None:  # merged: a gather's slow-rank scalars survive later gathers until logged
            self._pending.update(scalars)

    def utilisation(self, step_s: float) -> Utilisation | None:
        if self.flops_per_step is None or not self.main:
            return None
        return utilisation(self.flops_per_step, step_s, self.peak)

    def detail(self, step_s: float) -> str:
        """The progress line's part: achieved FLOP/s and MFU ("" when FLOPs are not known)."""
        util = self.utilisation(step_s)
        if util is None:
            return ""
        measured = (
            " (measured peak)"
            if util.mfu is not None and self.peak is not None and self.peak.measured
            else ""
        )
        return util.text() + measured

    def scalars(self, step_s: float | None = None, *, anatomy: bool = True) -> dict[str, float]:
        """FLOPs/MFU for a window of `step_s` seconds per step (None: this rank's median step from the
        anatomy), then (once each) the last gather's per-rank medians and slow-rank scalars."""
        if step_s is None:
            step_s = self.anatomy.medians().get("step", 0.0)
        util = self.utilisation(step_s) if step_s > 0 else None
        out = util.scalars() if util is not None else {}
        if anatomy:
            out.update(self._pending)
            self._pending = {}
        return out

    def summary(self) -> dict[str, Any]:
        """What `fit` returns: the ranks' last table, hosts, findings, this rank's recent steps, the peak."""
        return {
            **self.view.summary(),
            "history": [list(r) for r in self.anatomy.history],
            "flops_per_step": self.flops_per_step,
            "peak": self.peak,
        }


@dataclass
class Window:
    """Optimizer steps, samples over all ranks and seconds since the last report: its rates."""

    steps: int = 0
    samples: int = 0
    seconds: float = 0.0

    def add(self, samples: int, seconds: float) -> None:
        self.steps, self.samples, self.seconds = (
            self.steps + 1,
            self.samples + samples,
            self.seconds + seconds,
        )

    def take(self) -> dict[str, float]:
        rates = {"step_time": self.seconds / max(1, self.steps)}
        if self.samples and self.seconds > 0:
            rates["throughput"] = self.samples / self.seconds
        self.steps, self.samples, self.seconds = 0, 0, 0.0
        return rates
