"""Where one rank's step time goes, measured on every step at the cost of a few clock reads.

The loop (or the session) calls `mark(phase)` when a phase ENDS; the time since the previous mark is
that phase's. A training step, as `fit` and the session mark it:

    mark("other")       the loop's own work since the last step (logging, callbacks, progress)
    <next batch>  mark("data")       waiting for the loader
    <forward>     mark("forward")    s.backward entered (the train step: forward and loss)
    <backward>    mark("backward")   s.backward returned: split into "backward" and "sync", below
    <s.step>      mark("optimizer")  then end_step() once the optimizer step applied

The gradient-sync wait is measured, not modelled: `watch(model)` registers a post-accumulate-grad hook
on every parameter, which records the clock when this rank's LAST gradient is computed. DDP launches
each bucket's all-reduce as its gradients are ready and waits for all of them at the end of backward,
so the time from the last gradient to backward's return is the EXPOSED synchronisation wait: the part
of the all-reduce that did not overlap backward, plus the time spent waiting for slower ranks to send
theirs. A rank that waits for a slow one shows it here; the slow rank itself shows its extra time in
the phase where it spent it. Without `watch` (or under FSDP, whose sharded parameters take no such
hook) the wait stays inside "backward" and "sync" is 0. On a GPU the marks read the host clock: with
asynchronous kernels the host's phases shift (the wait shows where the host blocks); the step total
is right.

A mark made twice in a row (fit and the session both marking) adds a few microseconds to the phase;
a record without a backward is not a step, so a repeated `end_step()` is a no-op. Records are kept in a
ring (`window` steps for the medians, `keep` for `ddpkit trace --ranks`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from statistics import median
from typing import Any

import torch

PHASES = ("data", "forward", "backward", "sync", "optimizer", "other")
_INDEX = {name: i for i, name in enumerate(PHASES)}
_SYNC, _BACKWARD = _INDEX["sync"], _INDEX["backward"]


class StepAnatomy:
    """One rank's phase times per optimizer step; `medians()` over the last `window` steps."""

    def __init__(self, *, window: int = 20, keep: int = 512) -> None:
        self.window = window
        self.recent: deque[tuple[float, ...]] = deque(maxlen=window)  # the medians' steps
        self.history: deque[tuple[float, ...]] = deque(maxlen=keep)  # for `ddpkit trace --ranks`
        self.steps = 0  # steps recorded
        self._current = [0.0] * len(PHASES)
        self._cursor = time.perf_counter()
        self._last_grad = 0.0  # the clock at this rank's last computed gradient (watch's hooks)
        self._watched: set[int] = set()
        self._handles: list[Any] = []

    def mark(self, phase: str) -> None:
        """`phase` just ended: the time since the previous mark is its."""
        now = time.perf_counter()
        current = self._current
        i = _INDEX[phase]
        if i == _BACKWARD and self._cursor < self._last_grad <= now:
            current[_SYNC] += now - self._last_grad  # last gradient -> backward returned: waiting
            current[i] += self._last_grad - self._cursor
        else:
            current[i] += now - self._cursor
        self._cursor = now

    def skip(self) -> None:
        """Leave the time since the last mark out (evaluation between steps is no phase of a step)."""
        self._cursor = time.perf_counter()

    def end_step(self) -> None:
        """The optimizer step applied: the record is one step (a repeated call is a no-op)."""
        record = self._current
        if record[_BACKWARD] == 0.0:
            return
        done = tuple(record)
        self.recent.append(done)
        self.history.append(done)
        self.steps += 1
        self._current = [0.0] * len(PHASES)

    def stepped(self, applied: bool) -> None:
        """After `s.step`: the optimizer phase ended; a step when the optimizer step applied."""
        self.mark("optimizer")
        if applied:
            self.end_step()

    def watch(self, model: torch.nn.Module) -> None:
        """Time this rank's last gradient (see the module docstring); once per model."""
        if id(model) in self._watched:
            return
        self._watched.add(id(model))
        for p in model.parameters():
            if p.requires_grad and hasattr(p, "register_post_accumulate_grad_hook"):
                self._handles.append(p.register_post_accumulate_grad_hook(self._grad_ready))

    def _grad_ready(self, _param: torch.Tensor) -> None:
        self._last_grad = time.perf_counter()

    def unwatch(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._watched = [], set()

    def medians(self) -> dict[str, float]:
        """Median seconds per phase over the last `window` steps, plus "step" (their sum) and "busy"
        (the step without the sync wait: what this rank itself spent). Empty before the first step."""
        rows = list(self.recent)
        if not rows:
            return {}
        out = {name: median(r[i] for r in rows) for i, name in enumerate(PHASES)}
        out["step"] = median(sum(r) for r in rows)
        out["busy"] = median(sum(r) - r[_SYNC] for r in rows)
        return out


FIELDS = (*PHASES, "step", "busy")  # the order of a rank's row in the gathered table


def as_row(medians: dict[str, float], steps: int) -> list[float]:
    """A rank's medians as a fixed-length row (the all-gathered tensor): [steps, *FIELDS]."""
    return [float(steps), *(medians.get(name, 0.0) for name in FIELDS)]


def from_rows(rows: Iterable[Iterable[float]]) -> list[dict[str, float]]:
    """Each rank's row back to {"steps", *FIELDS}."""
    out = []
    for row in rows:
        values = list(row)
        out.append({"steps": values[0], **dict(zip(FIELDS, values[1:], strict=True))})
    return out
