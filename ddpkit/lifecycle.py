"""Joining and leaving the process group: the only calls to init/destroy_process_group.

Kept apart from `Session` so that the failure-handling policy lives in one place:

- three separate time limits (`Limits`): rendezvous, every collective, and a checkpoint save;
- a watchdog per process (`ddpkit.watchdog`) that turns a timed-out collective into a report of
  where every rank stands;
- keys in the c10d store for ddpkit's own coordination (checkpoint saves, stall reports), polled
  with deadlines so that a slow rank-0 save never trips the collective timeout of the others;
- an exit that cannot turn a finished run into a failure (`_exit_guard`, below).

Why the exit guard: a thread that returns from native code (a gloo worker releasing a tensor, a
daemon thread in a torch op) while the interpreter finalizes is ended by CPython with pthread_exit,
whose unwinding through a noexcept C++ frame calls std::terminate: "terminate called without an
active exception", SIGABRT, exit code 134, and torchrun marks a finished job FAILED (and restarts
it under --max-restarts). After a session that succeeded, ddpkit runs the remaining atexit handlers,
flushes every open file, and ends the process with os._exit(0) before finalization starts. It does
so only when the exit code is certainly 0: the main script ran to its end (its last instruction is
a return) or called sys.exit(0) at top level; any other ending is left to Python unchanged.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import dis
import gc
import io
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from types import FrameType
from typing import Any

import torch.distributed as dist

from ddpkit import failures
from ddpkit.errors import DdpkitError, problem
from ddpkit.topology import Plan
from ddpkit.watchdog import Watchdog, exception_position


@dataclass(frozen=True, kw_only=True)
class Limits:
    """Time limits in seconds, each for one kind of wait, so that each can fail with its own message.

    rendezvous: how long the ranks wait for each other to form the group at start (600);
    collective: how long one collective may wait for its peers (1800, the `timeout` of `session`);
    save: how long ranks wait for a checkpoint to be written (3600; rank 0 writes the shared files,
    and the others wait through the store, not in a collective, so a slow disk never trips the
    collective limit).
    """

    rendezvous: float = 600.0
    collective: float = 1800.0
    save: float = 3600.0

    def __post_init__(self) -> None:
        for name in ("rendezvous", "collective", "save"):
            value = getattr(self, name)
            if not value > 0:
                flag = "timeout" if name == "collective" else f"{name}_timeout"
                raise problem(f"{flag}={value} seconds is not positive", f"Pass {flag}= in seconds, e.g. 600")


_watchdog: Watchdog | None = None
_coordination: tuple[Any, Any, str] | None = None  # (group, store, key prefix)


def join_group(plan: Plan, limits: Limits) -> bool:
    """Initialise the default process group for `plan`; return True if this call created it."""
    global _watchdog
    if not plan.distributed or dist.is_initialized():
        return False
    r = plan.ranks
    init_method = "env://" if r.launcher == "torchrun" else f"tcp://{r.master_addr}:{r.master_port}"
    store, _, _ = next(
        dist.rendezvous(init_method, r.rank, r.world_size, timeout=timedelta(seconds=limits.rendezvous))
    )
    # torchrun's agent keeps one store across restarts: without a prefix per attempt, a restarted rank
    # can read the address a dead rank published and fail to connect ("Connection refused").
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") if r.launcher == "torchrun" else "0"
    dist.init_process_group(
        backend=plan.backend,
        store=dist.PrefixStore(f"ddpkit/attempt-{attempt}", store),
        rank=r.rank,
        world_size=r.world_size,
        timeout=timedelta(seconds=limits.rendezvous),  # the meeting: store waits and connections
    )
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=limits.collective))  # then every collective
    store_, prefix = coordination()
    warn_after = max(limits.collective * 0.8, limits.collective - 60)
    _watchdog = Watchdog(store_, prefix, r.rank, r.world_size, warn_after=warn_after).start()
    return True


def leave_group() -> None:
    """Stop the watchdog and destroy the default process group; after a success, guard the exit."""
    global _watchdog, _coordination
    if _watchdog is not None:
        _watchdog.stop()
        _watchdog = None
    _coordination = None
    if dist.is_initialized():
        dist.destroy_process_group()
        if not failures.failure_seen():
            _arm_exit_guard()


def coordination() -> tuple[Any, str]:
    """The default group's store, and a key prefix unique to this group (also in a long-lived pool).

    Every rank must make its first call at the same point of the program (all ranks join, or all
    ranks save), since the prefix comes from a counter in the store.
    """
    global _coordination
    group = dist.group.WORLD
    if _coordination is None or _coordination[0] is not group:
        store = dist.distributed_c10d._get_default_store()
        joined = int(store.add("ddpkit/groups", 1))
        _coordination = (group, store, f"ddpkit/{(joined - 1) // dist.get_world_size()}")
    return _coordination[1], _coordination[2]


def wait_for_keys(store: Any, keys: list[str], timeout: float, what: str) -> list[bytes]:
    """Poll the store until every key is set; non-blocking calls, so the watchdog can share the store."""
    end = time.monotonic() + timeout
    delay = 0.005
    while not store.check(keys):
        if time.monotonic() > end:
            missing = [k for k in keys if not store.check([k])]
            raise problem(
                f"gave up after {timeout:.0f} s waiting for {what} ({len(missing)} of {len(keys)} "
                "answer(s) missing)",
                "Look at the other ranks' output for their error; if they were only slow, raise "
                "save_timeout= in ddpkit.session(...)",
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.2)
    return [store.get(k) for k in keys]


def on_failure(session: Any, exc: BaseException) -> None:
    """Record a failure for `ddpkit run`; when a collective failed, raise a report of every rank."""
    failures.record_failure(exc, session.rank)
    if _watchdog is None or not _collective_failed(exc):
        return
    try:
        mine = exception_position(exc)
        report = _watchdog.gather(mine, deadline=min(10.0, 3 * _watchdog.poll + 2))
    except Exception:
        return  # reporting must never hide the original error
    limit = session.limits.collective
    culprit = f"{report.headline}\n" if report.headline else ""  # first: who stalled the others, where
    err = DdpkitError(
        f"{culprit}rank {session.rank}: a collective failed ({mine['state']} at {mine['where']}): "
        f"{str(exc).strip()[:300]}\n{report.ranks}\nFix the rank(s) named above; if they were only slow, "
        f"raise timeout= in ddpkit.session(...) (now {limit:.0f} s)."
    )
    err._ddpkit_time = failures.raised_at(exc)  # type: ignore[attr-defined]
    failures.record_failure(err, session.rank, when=failures.raised_at(exc), stalled=report.headline)
    raise err from exc


def _collective_failed(exc: BaseException) -> bool:
    """A timeout: some rank did not come. (A peer that died has its own error; ddpkit run shows it.)"""
    return isinstance(exc, RuntimeError) and ("Timed out" in str(exc) or "timed out" in str(exc))


# -- the exit guard -----------------------------------------------------------------------------------
_guard: dict[str, Any] = {}


def _arm_exit_guard() -> None:
    if _guard or os.environ.get("DDPKIT_EXIT_GUARD") == "0":
        return
    main = _main_frame()
    if main is None:
        return
    _guard["frame"] = main
    _guard["exit"] = sys.exit
    sys.exit = _recording_exit
    atexit.register(_exit_now)


def _main_frame() -> FrameType | None:
    """The outermost frame of the `__main__` module (the user's script), if we are inside it."""
    frame, found = sys._getframe(), None
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__main__":
            found = frame
        frame = frame.f_back
    return found


def _recording_exit(code: Any = None) -> Any:
    """`sys.exit`, noting a call made from the script's top level (the `sys.exit(main())` idiom)."""
    caller = sys._getframe(1)
    if caller is _guard.get("frame"):
        _guard["top_level_exit"] = (caller.f_lasti, code)
    return _guard["exit"](code)


def finished_with_zero(frame: FrameType) -> bool:
    """True only when the script's exit code is certainly 0."""
    if hasattr(sys, "last_value") or hasattr(sys, "last_exc"):
        return False  # an uncaught exception was printed: Python exits 1
    if dis.opname[frame.f_code.co_code[frame.f_lasti]] in ("RETURN_VALUE", "RETURN_CONST"):
        return True  # the script ran to its end
    lasti, code = _guard.get("top_level_exit", (None, 1))
    return lasti == frame.f_lasti and code in (0, None)


def _exit_now() -> None:
    frame = _guard.get("frame")
    if frame is None or not finished_with_zero(frame):
        return
    atexit.unregister(_exit_now)
    atexit._run_exitfuncs()  # the handlers registered before ours, as Python would run them
    _flush_all()
    os._exit(0)


def _flush_all() -> None:
    """What interpreter finalization would have flushed: open Python files and C stdio buffers."""
    for obj in gc.get_objects():
        if issubclass(type(obj), io.IOBase):  # type(), not isinstance: no proxy attribute access
            with contextlib.suppress(Exception):
                if not obj.closed and obj.writable():
                    obj.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).fflush(None)
