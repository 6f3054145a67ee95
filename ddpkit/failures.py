"""Which rank failed first, and why: the error file torchrun's agent reads, with a precise time.

When one rank raises, its peers fail moments later inside a collective ("connection closed by peer").
torchrun's error files carry whole-second timestamps, so the agent cannot tell cause from effect.
ddpkit writes the same file format with a sub-second `ddpkit_time`, and `ddpkit run` uses it to name
the rank that failed first.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import traceback
from typing import Any


def raised_at(exc: BaseException) -> float:
    """When `exc` was first seen by a ddpkit session (before teardown), or now."""
    return getattr(exc, "_ddpkit_time", None) or time.time()


_seen: list[float] = []  # this process's failures: a process that failed never gets the exit guard


def failure_seen() -> bool:
    """True once a session in this process has failed (see `ddpkit.lifecycle`'s exit guard)."""
    return bool(_seen)


def record_failure(exc: BaseException, rank: int, *, when: float | None = None) -> None:
    """Stamp `exc` with the time, and write it to the launcher's error file (TORCHELASTIC_ERROR_FILE).

    `when` keeps the time of an earlier exception that `exc` explains (a stall report raised after
    the timeout it describes), so the launcher still orders failures by when they happened.
    """
    now = when or getattr(exc, "_ddpkit_time", None) or time.time()
    _seen.append(now)
    with contextlib.suppress(AttributeError):
        exc._ddpkit_time = now  # type: ignore[attr-defined]
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or isinstance(exc, (KeyboardInterrupt, SystemExit)):
        return
    data = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(exc)),
                "timestamp": str(int(now)),
                "ddpkit_time": now,
                "rank": rank,
            },
        }
    }
    # Atomically: the agent reads the file as soon as this rank exits, and it may kill this rank (a peer
    # died) in the middle of writing; a half-written file would crash the agent's JSON parser.
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)  # reporting must never hide the user's own exception


def failure_time(failure: Any) -> float:
    """When a torchrun `ProcessFailure` happened, as precisely as its error file says."""
    data = failure.error_file_data
    if isinstance(data, dict):
        extra = data.get("message", {})
        extra = extra.get("extraInfo", {}) if isinstance(extra, dict) else {}
        if "ddpkit_time" in extra:
            return float(extra["ddpkit_time"])
    return float(failure.timestamp)


def failure_message(failure: Any) -> str:
    data = failure.error_file_data
    if isinstance(data, dict) and isinstance(data.get("message"), dict):
        return str(data["message"].get("message", ""))
    return ""
