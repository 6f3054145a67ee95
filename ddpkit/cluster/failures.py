"""Which rank failed first, and why: the error file torchrun's agent reads, with a precise time.

When one rank raises, its peers fail moments later inside a collective ("connection closed by peer").
torchrun's error files carry whole-second timestamps, so the agent cannot tell cause from effect.
ddpkit writes the same file format with a sub-second `ddpkit_time`, and `ddpkit run` uses it to name
the rank that failed first.

A timeout is different: the rank that failed first is the one that waited, not the cause. Its error
file then carries `ddpkit_stalled`, the stall report's headline naming the rank(s) that never came to
the collective, and `ddpkit run` leads with that (`stall_report`).

A mistake the user can fix (a `DdpkitError`: a refused checkpoint, a batch that does not divide) is
raised alike on every rank; a traceback from each would bury its one paragraph. Under `ddpkit run`
the error file marks it (`ddpkit_user_error`), the rank exits without a traceback (`hush`), and the
launcher prints the paragraph once (`user_error`).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from typing import Any

from ddpkit.names import PREEMPTED_EXIT_CODE, RUN_ENV


def raised_at(exc: BaseException) -> float:
    """When `exc` was first seen by a ddpkit session (before teardown), or now."""
    return getattr(exc, "_ddpkit_time", None) or time.time()


_seen: list[float] = []  # this process's failures: a process that failed never gets the exit guard


def failure_seen() -> bool:
    """True once a session in this process has failed (see `ddpkit.cluster.lifecycle`'s exit guard)."""
    return bool(_seen)


def stopped_cleanly(exc: BaseException) -> bool:
    """A preemption that saved (`ddpkit.cluster.preemption.Preempted`, exit code 75): not a failure."""
    return isinstance(exc, SystemExit) and exc.code == PREEMPTED_EXIT_CODE


def record_failure(
    exc: BaseException,
    rank: int,
    *,
    when: float | None = None,
    stalled: str | None = None,
    user_error: bool = False,
) -> None:
    """Stamp `exc` with the time, and write it to the launcher's error file (TORCHELASTIC_ERROR_FILE).

    `when` keeps the time of an earlier exception that `exc` explains (a stall report raised after
    the timeout it describes), so the launcher still orders failures by when they happened.
    `stalled` is that report's headline: which rank(s) did not reach the collective, and where.
    `user_error`: a DdpkitError, whose message is the whole report (see the module docstring).
    """
    if stopped_cleanly(exc):
        return  # a preemption that saved: the launcher's "resume me", not a failure
    now = when or getattr(exc, "_ddpkit_time", None) or time.time()
    _seen.append(now)
    with contextlib.suppress(AttributeError):
        exc._ddpkit_time = now  # type: ignore[attr-defined]
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path and not isinstance(exc, (KeyboardInterrupt, SystemExit)):
        write_error_file(path, exc, rank, now, stalled=stalled, user_error=user_error)


def hush(exc: BaseException) -> None:
    """Under `ddpkit run`, let `exc` end this process without a traceback: the launcher prints its
    message once for the job. Only this exception object; any other goes to the previous hook, so a
    user who catches it loses nothing (sys.excepthook is process-wide: docs/architecture.md)."""
    if os.environ.get(RUN_ENV) != "1" or not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if value is not exc:
            previous(kind, value, tb)

    sys.excepthook = hook


def write_error_file(
    path: str,
    exc: BaseException,
    rank: int,
    now: float,
    *,
    stalled: str | None = None,
    user_error: bool = False,
) -> None:
    """torchrun's error-file format, with ddpkit's sub-second time and the stall headline in extraInfo."""
    data = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(exc)),
                "timestamp": str(int(now)),
                "ddpkit_time": now,
                "rank": rank,
                **({"ddpkit_stalled": stalled} if stalled else {}),
                **({"ddpkit_user_error": str(exc)} if user_error else {}),
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
    extra = _extra(failure)
    if "ddpkit_time" in extra:
        return float(extra["ddpkit_time"])
    return float(failure.timestamp)


def stall_report(failures: dict[int, Any]) -> tuple[int, Any, str] | None:
    """(rank, failure, headline) of the first failure that is a timeout explained by a stall report.

    Only when no rank raised an error of its own before it: a rank that crashed is the cause, and is
    named as the first to fail. Failures without a message (the agent's SIGTERM to a rank that was
    stalled) do not count as earlier errors.
    """
    for rank, failure in sorted(failures.items(), key=lambda item: failure_time(item[1])):
        headline = _extra(failure).get("ddpkit_stalled")
        if headline:
            return rank, failure, str(headline)
        if failure_message(failure):
            return None
    return None


def user_error(failure: Any) -> str | None:
    """The paragraph of a DdpkitError a rank ended with (see the module docstring), or None."""
    text = _extra(failure).get("ddpkit_user_error")
    return str(text) if text else None


def _extra(failure: Any) -> dict:
    data = failure.error_file_data
    message = data.get("message") if isinstance(data, dict) else None
    extra = message.get("extraInfo") if isinstance(message, dict) else None
    return extra if isinstance(extra, dict) else {}


def failure_message(failure: Any) -> str:
    data = failure.error_file_data
    if isinstance(data, dict) and isinstance(data.get("message"), dict):
        return str(data["message"].get("message", ""))
    return ""
