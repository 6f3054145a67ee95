"""Where does every rank stand? Python stacks gathered through the c10d store, for stall reports.

When a collective times out, the rank that waited knows only that a peer did not come. Each rank
runs a small watchdog thread that, when asked through the store, publishes where its main thread is
(the collective it waits in, or the line of user code it is running), so the error can say
"rank 1 is not in the collective; it is at train.py:88 in time.sleep(60)". The store (not a process
group) carries the answers, so this works when the collective itself is broken, on gloo and NCCL.

The thread also watches its own rank: if the main thread waits in one collective for longer than
`warn_after` seconds, it prints the report before the backend's timeout fires, which matters for
NCCL, whose watchdog may end the process without a Python exception.

The thread polls with non-blocking store calls and is joined before the process exits: a thread
returning from native code while the interpreter finalizes would abort the process.
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import torch

_TORCH_DIR = str(Path(torch.__file__).parent)
_DDPKIT_DIR = str(Path(__file__).parent)
_STDLIB_DIRS = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib")})
_COLLECTIVE_FILES = (os.path.join("torch", "distributed"),)


# -- one rank's position --------------------------------------------------------------------------
def describe(frames: Sequence[traceback.FrameSummary]) -> dict[str, Any]:
    """Classify a stack (outermost first): which collective or phase, and the innermost user line."""
    state = "running (not in a collective)"
    for fr in reversed(frames):
        name, path = fr.name, fr.filename
        if any(part in path for part in _COLLECTIVE_FILES) and not name.startswith("_"):
            state = f"in {name}"
            break
        if os.path.join("torch", "autograd") in path:
            state = "in backward (DDP all-reduces gradients there)"
            break
        if os.path.join("torch", "utils", "data") in path:
            state = "waiting for data (DataLoader)"
            break
        if path.startswith(_DDPKIT_DIR) and Path(path).stem.startswith("checkpoint"):
            state = "in a checkpoint save/load"
            break
    user = next((fr for fr in reversed(frames) if _is_user(fr.filename)), frames[-1] if frames else None)
    where = f"{user.filename}:{user.lineno} in {user.name}: {(user.line or '').strip()}" if user else "?"
    return {"state": state, "where": where, "stack": [_line(fr) for fr in frames[-8:]]}


def _is_user(path: str) -> bool:
    return not path.startswith((_TORCH_DIR, _DDPKIT_DIR, *_STDLIB_DIRS)) and not path.startswith("<")


def _line(fr: traceback.FrameSummary) -> str:
    return f"{fr.filename}:{fr.lineno} in {fr.name}: {(fr.line or '').strip()}"


def main_thread_position() -> dict[str, Any]:
    frame: FrameType | None = sys._current_frames().get(threading.main_thread().ident or -1)
    return describe(traceback.extract_stack(frame) if frame else [])


def exception_position(exc: BaseException) -> dict[str, Any]:
    """Where the main thread was when `exc` was raised (from its traceback)."""
    return describe(traceback.extract_tb(exc.__traceback__))


# -- the watchdog ---------------------------------------------------------------------------------
class Watchdog:
    """Answers position requests from peers; warns when its own rank waits too long in a collective."""

    def __init__(self, store: Any, prefix: str, rank: int, world_size: int, *, warn_after: float,
                 poll: float = 1.0) -> None:  # fmt: skip
        self.store, self.prefix, self.rank, self.world_size = store, prefix, rank, world_size
        self.warn_after, self.poll = warn_after, poll
        self._stop = threading.Event()
        self._answered = 0
        self._waiting_since: tuple[str, float] | None = None
        self._warned = False
        self._thread = threading.Thread(target=self._run, name="ddpkit-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.poll + 5)

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            try:
                self._answer_requests()
                self._watch_main_thread()
            except Exception:  # the store is gone (the job is being torn down): nothing left to do
                return

    def _answer_requests(self) -> None:
        key = f"{self.prefix}/where/request"
        if not self.store.check([key]):
            return
        wanted = int(self.store.get(key).decode())
        if wanted > self._answered:
            self._publish(wanted, main_thread_position())

    def _publish(self, n: int, position: dict[str, Any]) -> None:
        self._answered = max(self._answered, n)
        answer = dict(position, n=n, rank=self.rank, pid=os.getpid(), time=time.time())
        self.store.set(f"{self.prefix}/where/{self.rank}", json.dumps(answer))

    def _watch_main_thread(self) -> None:
        position = main_thread_position()
        if not position["state"].startswith("in ") or "checkpoint" in position["state"]:
            self._waiting_since, self._warned = None, False
            return
        spot = position["state"] + position["where"]
        if self._waiting_since is None or self._waiting_since[0] != spot:
            self._waiting_since, self._warned = (spot, time.monotonic()), False
            return
        waited = time.monotonic() - self._waiting_since[1]
        if waited >= self.warn_after and not self._warned:
            self._warned = True
            report = self.gather(position, deadline=min(10.0, 3 * self.poll + 2))
            print(f"ddpkit: rank {self.rank} has waited {waited:.0f} s {position['state']}.\n{report}",
                  file=sys.stderr, flush=True)  # fmt: skip

    def gather(self, mine: dict[str, Any], deadline: float) -> str:
        """Ask every rank where it stands (through the store) and format the answers."""
        n = int(self.store.add(f"{self.prefix}/where/count", 1))
        self.store.set(f"{self.prefix}/where/request", str(n))
        self._publish(n, mine)
        answers: dict[int, dict[str, Any]] = {}
        end = time.monotonic() + deadline
        keys = {r: f"{self.prefix}/where/{r}" for r in range(self.world_size)}
        while len(answers) < self.world_size and time.monotonic() < end:
            for r, key in keys.items():
                if r not in answers and self.store.check([key]):
                    answer = json.loads(self.store.get(key).decode())
                    if answer["n"] >= n:
                        answers[r] = answer
            time.sleep(0.05)
        return format_report(answers, self.world_size, mine["state"])


def format_report(answers: dict[int, dict[str, Any]], world_size: int, waited_in: str) -> str:
    """One line per rank, and the ranks that are not where the waiting rank is."""
    lines, stalled = [], []
    for r in range(world_size):
        a = answers.get(r)
        if a is None:
            lines.append(f"  rank {r}: did not answer (blocked in native code holding the GIL, or gone)")
            stalled.append(r)
            continue
        lines.append(f"  rank {r}: {a['state']} at {a['where']}")
        if a["state"] != waited_in:
            stalled.append(r)
    head = "Where every rank stands:"
    if stalled and len(stalled) < world_size:
        names = ", ".join(str(r) for r in stalled)
        head = f"Rank(s) {names} never entered the collective the others wait in ({waited_in}). " + head
    return "\n".join([head, *lines])
