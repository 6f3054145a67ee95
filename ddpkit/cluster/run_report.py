"""What `ddpkit run` says when workers fail: at every restart, and when the job ends.

torchrun's agent names the first failure by its error file's whole-second timestamp, or by the second
in which it noticed an exit, so a peer that failed a moment later in a collective ("connection closed
by peer") can be named instead of the rank that died. ddpkit orders failures by what they are:

1. a rank that ended without an exception, by a signal other than the agent's own SIGTERM (the OOM
   killer, a user's `kill -9`, a segfault) or by an exit code (`os._exit`), caused the others' failures;
2. then the ranks that raised, the earliest by ddpkit's sub-second time (`ddpkit.cluster.failures`): the
   peers that failed in a collective come after the rank that broke it;
3. last the ranks the agent stopped (SIGTERM, no exception): victims, never the cause while others
   failed otherwise (their times are only the second in which the agent noticed them);

and says it in one line per restart (the agent restarts every worker after a failure while
--max-restarts allows) and in one report at the end. A timeout leads with the rank(s) that never came
(`failures.stall_report`); a mistake the user can fix (a DdpkitError) is its own one paragraph.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import sys
from collections.abc import Iterator
from typing import Any

from ddpkit.cluster.failures import failure_message, failure_time, stall_report, user_error


def first_failure(failures: dict[int, Any]) -> tuple[int, Any]:
    """(global rank, torchrun ProcessFailure) of the failure that caused the others (module docstring)."""

    def key(item: tuple[int, Any]) -> tuple[int, float]:
        failure = item[1]
        if failure_message(failure):
            return (1, failure_time(failure))  # raised: its error file has ddpkit's sub-second time
        if failure.exitcode == -signal.SIGTERM:
            return (2, failure_time(failure))  # the agent's stop of the survivors (or a scheduler's)
        return (0, failure_time(failure))  # killed from outside, or exited without an exception

    return min(failures.items(), key=key)


def how_it_ended(failure: Any) -> str:
    """How a failure ended, e.g. "died first, killed by SIGKILL" or "failed first with ValueError: ..."."""
    message = failure_message(failure).rstrip(".")
    if message:
        return f"failed first with {message.splitlines()[0][:300]}"
    if failure.exitcode < 0:
        return f"died first, killed by {signal.Signals(-failure.exitcode).name}"
    return f"exited first with code {failure.exitcode}"


def how_the_others_ended(failures: dict[int, Any], first: int) -> str:
    """How the ranks other than `first` ended, counted, e.g. "1 by SIGTERM": the agent's SIGTERM should
    end them at once; "by SIGKILL" means one lived on through it until the agent's kill (30 s later),
    e.g. a survivor that took the agent's stop for a preemption (`cluster.preemption`)."""
    endings: dict[str, int] = {}
    for rank, failure in failures.items():
        if rank == first:
            continue
        if failure_message(failure):
            how = "raised"
        elif failure.exitcode < 0:
            how = f"by {signal.Signals(-failure.exitcode).name}"
        else:
            how = f"exited with code {failure.exitcode}"
        endings[how] = endings.get(how, 0) + 1
    return ", ".join(f"{n} {how}" for how, n in sorted(endings.items()))


def restart_line(failures: dict[int, Any], restart: int, budget: int, host: str) -> str:
    rank, first = first_failure(failures)
    return (
        f"ddpkit run: restart {restart} of {budget}: rank {rank} (local rank {first.local_rank} on host "
        f"{host}, pid {first.pid}) {how_it_ended(first)}; {len(failures)} rank(s) failed on this host; "
        "every worker restarts and resumes from its newest checkpoint"
    )


@contextlib.contextmanager
def restart_reports(max_restarts: int) -> Iterator[None]:
    """While torchrun's agent runs in this process: one `restart_line` per restart, on stderr.

    The agent has no public hook that sees each attempt's failures (its events report them only at
    the end), so this wraps LocalElasticAgent._monitor_workers, which returns them: a private seam of
    torch, used here only, for the duration of the run, and tested (tests/test_run_reports.py fails if
    torch renames it). A FAILED result while restarts remain is followed by a restart.
    """
    if max_restarts <= 0:
        yield
        return
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    original = LocalElasticAgent._monitor_workers
    done = [0]
    host = socket.gethostname()

    def monitor(agent: Any, worker_group: Any) -> Any:
        result = original(agent, worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and done[0] < max_restarts:
            done[0] += 1
            if result.failures:
                print(restart_line(result.failures, done[0], max_restarts, host), file=sys.stderr, flush=True)
        return result

    LocalElasticAgent._monitor_workers = monitor  # type: ignore[method-assign]
    try:
        yield
    finally:
        LocalElasticAgent._monitor_workers = original  # type: ignore[method-assign]


def report(err: Exception, max_restarts: int = 0) -> int:
    """The one report when the job ends in failure; the exit code `ddpkit run` returns."""
    failures = getattr(err, "failures", {})
    if not failures:
        print(f"ddpkit run: the job failed: {err}", file=sys.stderr)
        return 1
    mistakes = {r: text for r, f in failures.items() if (text := user_error(f))}
    if mistakes:  # a DdpkitError: its paragraph is the report (the ranks printed no traceback)
        rank = min(mistakes, key=lambda r: (mistakes[r] != mistakes.get(0), r))  # rank 0's when it has one
        alike = sum(text == mistakes[rank] for text in mistakes.values())
        where = f"by {alike} ranks alike" if alike > 1 else f"by rank {rank}"
        rest = "; the others were stopped" if alike < len(failures) else ""
        print(
            f"ddpkit run: {mistakes[rank]}\n(raised {where}{rest}; exit code 1)", file=sys.stderr, flush=True
        )
        return 1
    rank, first = first_failure(failures)
    stalled = stall_report(failures)  # a timeout: lead with the rank(s) that never came, not the first victim
    if stalled is not None:
        rank, first, _ = stalled
    code = first.exitcode
    how = f"exit code {code}"
    message = failure_message(first).rstrip(".")
    if code < 0 and message:
        # It raised (its error file says what), then ended by a signal while exiting: the agent's
        # SIGTERM when a peer's exit was noticed first, or an abort in teardown. Report the exception.
        how, code = f"an exception (the process then ended by {signal.Signals(-code).name} while exiting)", 1
    elif code < 0:
        how = f"signal {signal.Signals(-code).name}"
        code = 128 - code
    lead = f"{stalled[2]}. Then " if stalled else ""
    verb = "timed out waiting and ended with" if stalled else "failed first with"
    above = "; its traceback is above" if message else ""  # none from a rank killed by a signal
    message = "" if stalled else message  # the timeout's own message is the report above
    print(
        f"ddpkit run: {lead}rank {rank} (local rank {first.local_rank}, pid {first.pid}) {verb} "
        f"{how}{': ' + message if message else ''}{above}. {len(failures)} rank(s) failed; the others "
        f"were stopped{f' ({others})' if (others := how_the_others_ended(failures, rank)) else ''}."
        + (f" The restart budget (--max-restarts {max_restarts}) is used up." if max_restarts else ""),
        file=sys.stderr,
        flush=True,
    )
    return code
