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
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import torch

_TORCH_DIR = str(Path(torch.__file__).parent)
_DDPKIT_DIR = str(Path(__file__).parent.parent)  # the package ddpkit/, this file is in ddpkit/cluster/
_CHECKPOINT_DIR = os.path.join(_DDPKIT_DIR, "checkpoint", "")  # the checkpoint wing
_STDLIB_DIRS = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib")})
_COLLECTIVE_FILES = (os.path.join("torch", "distributed"),)


# -- one rank's position --------------------------------------------------------------------------
_NOT_IN_COLLECTIVE = "running (not in a collective)"
_BACKWARD = "in backward: DDP's gradient all-reduce"
# DDP calls its collectives from its own Python methods straight into C++ (the reducer's bucket rebuild,
# dist._broadcast_coalesced): no torch.distributed function is on the stack, so they are told by file.
_DDP_FILES = (
    os.path.join("torch", "nn", "parallel", "distributed.py"),
    os.path.join("torch", "distributed", "utils.py"),
)


def describe(frames: Sequence[traceback.FrameSummary]) -> dict[str, Any]:
    """Classify a stack (outermost first): which collective or phase, and the innermost user line.

    `collective` is True when the rank waits for its peers (a torch.distributed call, one of DDP's
    collectives, or backward, where DDP all-reduces gradients): a rank that is not, while others
    are, is the one that stalls them.
    """
    state, collective = _ddp_collective(frames), True
    for fr in reversed(frames if state is None else ()):
        name, path = fr.name, fr.filename
        if any(part in path for part in _COLLECTIVE_FILES) and not name.startswith("_"):
            state = f"in {name}"
            break
        if os.path.join("torch", "autograd") in path:
            state = _BACKWARD
            break
        if os.path.join("torch", "utils", "data") in path:
            state, collective = "waiting for data (DataLoader)", False
            break
        # the checkpoint wing, and (as before the move) any ddpkit module named checkpoint*
        if path.startswith(_CHECKPOINT_DIR) or (
            path.startswith(_DDPKIT_DIR) and Path(path).stem.startswith("checkpoint")
        ):
            state, collective = "in a checkpoint save/load", False
            break
    if state is None:
        state, collective = _NOT_IN_COLLECTIVE, False
    user = next((fr for fr in reversed(frames) if _is_user(fr.filename)), frames[-1] if frames else None)
    where = f"{user.filename}:{user.lineno} in {user.name}: {(user.line or '').strip()}" if user else "?"
    at = f"{os.path.basename(user.filename)}:{user.lineno}" if user else "?"
    return {
        "state": state,
        "collective": collective,
        "where": where,
        "at": at,
        "stack": [_line(fr) for fr in frames[-8:]],
    }


def _ddp_collective(frames: Sequence[traceback.FrameSummary]) -> str | None:
    """The DDP collective the innermost frame waits in, if it is one of DDP's own call sites."""
    if not frames or not frames[-1].filename.endswith(_DDP_FILES):
        return None
    inner, line = frames[-1], frames[-1].line or ""
    ddp = {fr.name for fr in frames if fr.filename.endswith(_DDP_FILES[0])}
    if "__init__" in ddp:
        return "in DDP's construction: its shape check and weight broadcast"
    if "_sync_final_model" in ddp:
        return "in DDP's join: its final weight broadcast"
    if "_rebuild_buckets" in line or (not line and inner.name == "_pre_forward"):
        return "in DDP's forward: its bucket rebuild"
    if "broadcast" in line or inner.name.startswith(
        ("_sync", "_default_broadcast", "_distributed_broadcast")
    ):
        return "in DDP's forward: its buffer broadcast"
    return None


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

    def __init__(
        self, store: Any, prefix: str, rank: int, world_size: int, *, warn_after: float, poll: float = 1.0
    ) -> None:
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

    def heartbeat_key(self, rank: int) -> str:
        """Where rank `rank`'s watchdog counts its polls: a rank whose count stops is gone."""
        return f"{self.prefix}/alive/{rank}"

    def _run(self) -> None:
        beats = 0
        while not self._stop.wait(self.poll):
            try:
                beats += 1
                self.store.set(self.heartbeat_key(self.rank), str(beats))  # peers waiting on us see we live
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
        if not position["collective"]:
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
            lead = f"ddpkit: {report.headline}\n" if report.headline else "ddpkit: "
            print(
                f"{lead}rank {self.rank} has waited {waited:.0f} s {position['state']}.\n{report.ranks}",
                file=sys.stderr,
                flush=True,
            )

    def gather(self, mine: dict[str, Any], deadline: float) -> Report:
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
        return format_report(answers, self.world_size)


# -- the report -----------------------------------------------------------------------------------
_SILENT = "did not answer (blocked in native code holding the GIL, or gone)"


@dataclass(frozen=True)
class Report:
    """Every rank's position (`ranks`); `headline` names the culprit when the positions show one.

    The culprit of a timeout is the rank that is NOT in a collective while others wait in one; the
    rank whose collective timed out first is only its first victim, so the headline comes first.
    """

    headline: str | None
    ranks: str

    @property
    def text(self) -> str:
        return f"{self.headline}\n{self.ranks}" if self.headline else self.ranks


def format_report(answers: dict[int, dict[str, Any]], world_size: int) -> Report:
    """The headline (who stalls the others), then one line per rank."""
    lines = [f"  rank {r}: {_position(r, answers)}" for r in range(world_size)]
    return Report(_culprit(answers, world_size), "\n".join(["Where every rank stands:", *lines]))


def _position(rank: int, answers: dict[int, dict[str, Any]]) -> str:
    a = answers.get(rank)
    return f"{a['state']} at {a['where']}" if a else _SILENT


def _culprit(answers: dict[int, dict[str, Any]], world_size: int) -> str | None:
    """The ranks not in a collective while others wait in one; or that the waits do not match."""
    waiting = {r: a for r, a in sorted(answers.items()) if a.get("collective")}
    behind = [r for r in range(world_size) if r not in waiting]
    if waiting and behind:
        spots = {(a["state"].removeprefix("in "), a["at"]) for a in waiting.values()}
        if len(spots) == 1:
            waited = "{}, at {}".format(*spots.pop())
        else:
            waited = "; ".join(
                f"rank {r}: {a['state'].removeprefix('in ')} at {a['at']}" for r, a in waiting.items()
            )
        where = "; ".join(
            f"rank {r} is at {answers[r]['where']}" if r in answers else f"rank {r} {_SILENT}" for r in behind
        )
        verb = "waits" if len(waiting) == 1 else "wait"
        return (
            f"{_ranks(behind)} did not reach the collective that {_ranks(waiting)} {verb} in ({waited}): "
            + where
        )
    if len({a["state"] for a in waiting.values()}) > 1:
        places = "; ".join(f"rank {r} {a['state']} at {a['at']}" for r, a in waiting.items())
        return (
            f"every rank waits in a collective, but not in the same one ({places}): every rank must call "
            "the same collectives in the same order"
        )
    return None


def _ranks(ranks: Any) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(str(r) for r in ranks)
