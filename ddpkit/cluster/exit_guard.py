"""An exit that cannot turn a finished run into a failure: the one deliberate process-wide state.

Why: a thread that returns from native code (a gloo worker releasing a tensor, a daemon thread in a
torch op) while the interpreter finalizes is ended by CPython with pthread_exit, whose unwinding
through a noexcept C++ frame calls std::terminate: "terminate called without an active exception",
SIGABRT, exit code 134, and torchrun marks a finished job FAILED (and restarts it under
--max-restarts). After a session that succeeded, ddpkit runs the remaining atexit handlers, flushes
every open file, and ends the process with os._exit(0) before finalization starts. It does so only
when the exit code is certainly 0: the main script ran to its end (its last instruction is a return)
or called sys.exit(0) at top level; any other ending is left to Python unchanged.

Process-wide state kept here, on purpose (an exit belongs to the process, not to a session):
- `_guard`: the script's outermost frame and the original `sys.exit`, set once per process;
- `sys.exit` replaced by `_recording_exit`, which notes a top-level `sys.exit(code)` and calls the
  original (so the `sys.exit(main())` idiom is recognised);
- one `atexit` hook, `_exit_now`.
`DDPKIT_EXIT_GUARD=0` turns it off. Nothing else in ddpkit keeps state beyond a session.
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
from types import FrameType
from typing import Any

from ddpkit.names import EXIT_GUARD_ENV

_guard: dict[str, Any] = {}


def arm() -> None:
    """After a successful session: end the process with os._exit(0) if the script then ends with 0."""
    if _guard or os.environ.get(EXIT_GUARD_ENV) == "0":
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
    frame: FrameType | None = sys._getframe()
    found: FrameType | None = None
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
