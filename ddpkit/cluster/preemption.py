"""Preemption: a signal asks the job to stop; every rank stops at the same step, saves, and exits 75.

    step = s.load("runs/ckpt", **state, step=0)["step"]   # ddpkit now knows what to save
    for x, y in train:                                    # s.loader: a stop is saved at the next batch
        ...; opt.step()                                   # or s.step(opt)
        step += 1
        if step % 500 == 0:                               # or s.save(..., every=500) after every step
            s.save("runs/ckpt", **state, step=step)

SIGTERM, or the preemption signal (SIGUSR1 by default, as Slurm's `--signal=USR1@120` sends; `ddpkit
run --preemption-signal USR2` for submitit's), only sets a flag (a handler that saved from inside the
signal could run in the middle of a backward, or of Python's own internals). The ranks agree on the
flag at the step boundaries ddpkit owns (`ddpkit.checkpoint.checkpoints`): `s.step` (an optimizer
step), `s.save`, and, in a loop that calls neither since its last batch (plain `opt.step()`), the
loader's next batch; the stop saves the state last given to `s.load`/`s.save` (its `step` advanced by
the optimizer steps since) at the next boundary. Every k-th call, every rank contributes its flag to
one asynchronous all-reduce (MAX of [signal number, proposed k]) and reads the result of the previous
one, which finished long before; so every rank reaches the same answer at the same call, even when
the signal reached the ranks steps apart. k starts at 1 and is itself agreed in that all-reduce,
chosen so that agreeing costs under 0.5% of the step time while a stop is still seen within about a
second (on this 2-core machine an agreement took ~0.2 ms of a 6 ms CNN step: every call would cost
3%). When the answer is "stop", the ranks save (synchronously) and raise `Preempted` (exit code 75,
"preempted, resume me"), after global rank 0 has told `ddpkit run` where the checkpoint is and, under
Slurm, requeued the job.

A second signal during the save only sets the flag again. A save that cannot finish in the grace
time (the launcher's `--grace`, then SIGKILL) leaves the previous checkpoint the newest valid one:
checkpoints are renamed into place only when complete.

What the launcher passes down (environment variables a rank must inherit; read here only):
`DDPKIT_PREEMPTION_SIGNAL` (a signal name), `DDPKIT_REQUEUE` ("auto", "1" or "0"),
`DDPKIT_PREEMPTION_RECORD` (a file where global rank 0 writes the step and the checkpoint).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.cluster import requeue
from ddpkit.cluster.signals import PreemptionOptions, signal_of
from ddpkit.names import PREEMPTED_EXIT_CODE, PREEMPTION_RECORD_ENV, SIGNALLED_FILE

__all__ = ["Preempted", "Preemption", "PreemptionOptions", "signal_of"]

NOTHING_TO_SAVE = (
    "nothing to save: this script never passed its state to s.load or s.save. Add, before the loop, "
    '`step = s.load("runs/ckpt", model=model, optimizer=opt, loader=train, step=0)["step"]` and ddpkit '
    "saves that state at the step a preemption stops (README, Checkpoints and restarts)"
)
COST_SHARE = 0.005  # agreements may cost this share of the training time
MAX_LATENCY_S = 1.0  # ... but come at least about this often
MAX_INTERVAL = 1000


class Preempted(SystemExit):
    """Raised at the agreed stop after the preemption checkpoint is committed (exit code 75, `ddpkit.names`;
    `ddpkit.cluster.failures` does not count it as a failure)."""

    def __init__(self, step: Any, checkpoint: Path, signal_name: str) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.step, self.checkpoint, self.signal_name = step, checkpoint, signal_name


class Preemption:
    """One session's preemption state: the handlers, the flag, the agreement in flight."""

    def __init__(self, options: PreemptionOptions, env: Mapping[str, str]) -> None:
        self.options, self.env = options, env
        self.asked: str | None = None  # the name of the first signal seen
        self.agreed = False  # every rank agreed to stop (set by `agree`, at the same call everywhere)
        self.remedy: str | None = None  # nothing to save yet: said at a signal, which then acts as before
        self._previous: dict[signal.Signals, Any] = {}
        self._pending: tuple[Any, torch.Tensor] | None = None
        self._calls, self._due = 0, 1  # calls of agree(); the call of the next agreement
        self._last_call: float | None = None
        self._step: float | None = None  # seconds between calls (a moving average)
        self._cost: float | None = None  # seconds an agreement takes (a moving average)

    def arm(self, remedy: str | None = None) -> None:
        """Install the flag-setting handlers (once; only the main thread may). Until `remedy` is cleared
        (the session was given state to save), a signal prints `remedy` (if not empty) and then does
        what it did before ddpkit (the previous handler, e.g. the default: the process ends)."""
        if self._previous or threading.current_thread() is not threading.main_thread():
            return
        self.remedy = remedy
        for sig in self.options.signals:
            self._previous[sig] = signal.signal(sig, self._handler)

    def _handler(self, signum: int, frame: Any) -> None:
        stopping = signum == signal.SIGTERM and not self._launcher_signalled()
        if self.remedy is not None or stopping:  # nothing to save, or not a preemption: as without ddpkit
            if self.remedy and not stopping:
                os.write(2, f"ddpkit: {signal.Signals(signum).name}: {self.remedy}\n".encode())
            self.close()
            signal.raise_signal(signum)
            return
        self.asked = self.asked or signal.Signals(signum).name  # only a flag: see the module docstring

    def _launcher_signalled(self, wait: float = 1.0) -> bool:
        """Under `ddpkit run`, a SIGTERM is a preemption only when the launcher itself was signalled (it
        marks that before passing the signal on: `cluster.launch.marking_signals`); its agent also
        SIGTERMs the survivors of a failed rank, which must end at once. Slurm may signal the ranks
        and the launcher together, so the mark is waited for up to `wait` seconds. Elsewhere: True."""
        record = self.env.get(PREEMPTION_RECORD_ENV)
        if not record:
            return True
        marker = Path(record).with_name(SIGNALLED_FILE)
        end = time.monotonic() + wait
        while not marker.exists():
            if time.monotonic() > end:
                return False
            time.sleep(0.02)
        return True

    def agree(self, distributed: bool, device: torch.device, *, now: bool = False) -> bool:
        """True on every rank at the same call when any rank was signalled before the last agreement.

        Every `interval`-th call all-reduces (MAX) [signal number, proposed interval] asynchronously
        and reads the previous agreement's result, so the interval itself is agreed: every rank
        counts the same calls and meets at the same ones, whatever its own clock says. `now=True`
        (a scheduled save, the same call on every rank) agrees synchronously, so a stop is never
        later than the next regular checkpoint, however long the interval grew.
        """
        if not distributed:
            self.agreed = self.agreed or self.asked is not None
            return self.agreed
        self._calls += 1
        t0 = time.perf_counter()
        if self._last_call is not None:
            between = t0 - self._last_call
            self._step = between if self._step is None else 0.9 * self._step + 0.1 * between
        self._last_call = t0
        if self._calls < self._due and not now:
            return False
        stop = False
        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            signum, interval = (int(v) for v in flag.tolist())
            self._due = self._calls + max(1, interval)
            if signum:
                self.asked = self.asked or signal.Signals(signum).name
                stop = self.agreed = True
        else:
            self._due = self._calls + 1
        mine = 0 if self.asked is None else int(signal.Signals[self.asked])
        flag = torch.tensor([mine, self._propose()], dtype=torch.int64, device=device)
        if now:  # the save that follows costs far more than waiting for this one all-reduce
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            self._pending = None
            signum, interval = (int(v) for v in flag.tolist())
            self._due = self._calls + max(1, interval)
            if signum:
                self.asked = self.asked or signal.Signals(signum).name
                stop = self.agreed = True
        else:
            self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), flag)
        spent = time.perf_counter() - t0
        self._cost = spent if self._cost is None else 0.8 * self._cost + 0.2 * spent
        return stop

    def restart_clock(self) -> None:
        """Time the calls afresh from the next one: the last call was not a step's length ago. (A loop's
        first batch agrees at the loader's boundary before ddpkit knows the loop calls `s.step`; its first
        `s.step` follows within the same step. Timed as a step, that fraction seeded the step estimate
        several times too short, and the interval agreed from it, read as "1 s of steps", spanned many
        seconds: a signal early in a 24-step run was seen only after its end.)"""
        self._last_call = None

    def _propose(self) -> int:
        """Calls between agreements: enough that their cost stays under 0.5% of the steps, and few
        enough that a stop is seen within about a second."""
        if self._step is None or self._cost is None or self._step <= 0:
            return 1
        wanted = math.ceil(self._cost / (COST_SHARE * self._step))
        return max(1, min(wanted, int(MAX_LATENCY_S / self._step), MAX_INTERVAL))

    def finish(self, *, is_main: bool, step: Any, checkpoint: Path, say: Callable[[str], None]) -> Preempted:
        """After the preemption checkpoint is committed: tell the launcher, requeue, and the exception."""
        how = self.asked or "a signal"
        say(
            f"ddpkit: preempted ({how}) at step {step}: saved {checkpoint}; exiting with code "
            f"{PREEMPTED_EXIT_CODE} (resume by starting the same command)"
        )
        if is_main:
            requeued = requeue.of(self.env).requeue(self.options.requeue, say)  # the launcher's way
            record = self.env.get(PREEMPTION_RECORD_ENV)
            if record:
                with contextlib.suppress(OSError):
                    Path(record).write_text(
                        json.dumps(
                            {"step": step, "checkpoint": str(checkpoint), "signal": how, "requeued": requeued}
                        )
                    )
        return Preempted(step, checkpoint, how)

    def close(self) -> None:
        """Finish the agreement in flight and put the previous handlers back."""
        pending, self._pending = self._pending, None
        if pending is not None:
            with contextlib.suppress(Exception):
                pending[0].wait()
        for sig, previous in self._previous.items():
            with contextlib.suppress(Exception):
                signal.signal(sig, previous)
        self._previous.clear()
