"""A checkpoint written behind training: one thread, one write at a time, errors raised to the caller.

    s.save("runs/ckpt", **state, step=step, background=True)   # copies the state to CPU and returns

The state was already copied (`ddpkit.checkpoint.write.capture(copy=True)`, into memory kept from one
save to the next: `Background.staging`), so training may change
the originals while the thread writes the files, hashes them and (rank 0, once every rank's part is
in) commits the checkpoint by renaming it into place. Until then the previous checkpoint is the
newest valid one, so a crash in the middle loses nothing that was committed. The next save, a load,
and the session's end wait for the write in flight; its error, if any, is raised there.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from typing import Any

import torch

from ddpkit.checkpoint.staging import Arena

NICE = 19  # the writer's niceness: it runs on CPU time training leaves idle


def idle_priority() -> bool:
    """Run the calling thread only when a core would otherwise be idle (Linux SCHED_IDLE, this thread
    only): the writer then takes no CPU time from training ranks that fill every core. A thread that
    blocks on it (the next save, a load, the end) leaves its core idle, so the writer always
    finishes. True if set."""
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
        return True
    return False


def lower_priority(nice: int = NICE) -> bool:
    """Make the calling thread the lowest CPU priority (Linux: a thread is a task with its own nice
    value, set through its native id). Measured: with two ranks on two cores the writer otherwise
    takes CPU time from training at equal priority. False where the platform cannot do it."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (AttributeError, OSError):
        return False
    return True


def writer_group(nice: int | None) -> Any:
    """The background saves' own gloo group, made on a thread at the writer's priority.

    gloo starts the group's worker threads (which run its collectives: the optimizer shares sent to
    rank 0, DCP's gathers) and its transport thread in the group's constructor, and a Linux thread
    takes its creator's scheduling policy and nice value. Made on training's thread, they ran at
    training's priority: the writer waited at the lowest priority while gloo copied a rank's 160 MiB
    share through the loopback at full priority, on cores the ranks keep busy. Made here, they run on
    CPU time training leaves idle, as the writer does. Every rank calls it at the same point."""
    import torch.distributed as dist

    made: dict[str, Any] = {}

    def make() -> None:
        if nice is not None:
            idle_priority()
            lower_priority(nice)
        try:
            made["group"] = dist.new_group(backend="gloo")
        except BaseException as err:  # raised on the caller's thread below
            made["error"] = err

    thread = threading.Thread(target=make, name="ddpkit-writer-group")
    thread.start()
    thread.join()
    if "error" in made:
        raise made["error"]
    return made["group"]


class Background:
    """At most one write in flight; `wait` joins it and raises what it raised."""

    def __init__(self, *, nice: int | None = NICE) -> None:
        self._nice = nice  # None: the writer keeps training's priority
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._arena: Arena | None = None
        self.result: Any = None

    def staging(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """Where the next save's copy goes (`capture`'s `stage`): the memory of the last save's copy, reused
        (`ddpkit.checkpoint.staging.Arena`; the last write has finished), so a save after the first
        faults in no new pages on training's thread: measured under FSDP (37.8M MLP, 2 ranks, 216 MiB
        a rank), a clone into fresh memory took 160 ms of its CPU against 34 ms, and the call 0.19 s
        against 0.05-0.07 s (docs/fault-tolerance.md).
        The copy's memory is then held between saves, as the writer process's is. None where memfd is
        missing (not Linux): a clone."""
        if not Arena.available():
            return None
        self.wait()
        if self._arena is None:
            self._arena = Arena()
        self._arena.reset()
        return self._arena.stage

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def run(self, write: Callable[[], Any]) -> None:
        self.wait()

        def body() -> None:
            if self._nice is not None:  # SCHED_IDLE, and nice (which counts where SCHED_IDLE is refused)
                idle_priority()
                lower_priority(self._nice)
            try:
                self.result = write()
            except BaseException as err:  # handed to the main thread by wait()
                self._error = err

        # not a daemon: an interpreter that exits waits for the commit rather than cut it off
        self._thread = threading.Thread(target=body, name="ddpkit-checkpoint-writer")
        self._thread.start()

    def wait(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self) -> None:
        """Finish the write in flight (its error is raised), then release the staging memory."""
        try:
            self.wait()
        finally:
            if self._arena is not None:
                self.result = None  # the last write's answer may hold views of the arena
                self._arena.close()
                self._arena = None
