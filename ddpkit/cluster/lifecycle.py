"""Joining and leaving the process group: the only calls to init/destroy_process_group.

Kept apart from `Session` so that the failure-handling policy lives in one place:

- three separate time limits (`Limits`): rendezvous, every collective, and a checkpoint save;
- a watchdog per process (`ddpkit.cluster.watchdog`) that turns a timed-out collective into a report of
  where every rank stands;
- keys in the c10d store for ddpkit's own coordination (checkpoint saves, stall reports), polled
  with deadlines so that a slow rank-0 save never trips the collective timeout of the others;
- an exit that cannot turn a finished run into a failure (`ddpkit.cluster.exit_guard`, armed by `leave`);
- a tag per call of the session's own collectives (`Membership.agree`: s.save, s.load, s.export, and a
  script's s.all_reduce, s.gather, s.any_rank, ...), numbered the same on every rank, so ranks that part
  are named by their calls (one at `s.save`, the other in `s.backward`, or past the end of its session)
  in seconds, before a collective of the wrong size aborts or the collective limit runs out. The training
  step itself carries no tag (nothing added per step).

All of it hangs off one `Membership` per session (`join` returns it); nothing here is module state.
"""

from __future__ import annotations

import contextlib
import json
import linecache
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ddpkit.cluster import exit_guard, failures, rendezvous_report
from ddpkit.cluster.exit_guard import finished_with_zero
from ddpkit.cluster.topology import Placement
from ddpkit.cluster.watchdog import _DDPKIT_DIR, _TORCH_DIR, Watchdog, exception_position
from ddpkit.errors import DdpkitError, problem

__all__ = ["Limits", "Membership", "finished_with_zero", "join", "on_failure", "wait_for_keys"]


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


class Membership:
    """This session's place in the process group: its store keys, its watchdog, its failures.

    One per distributed session (`join`), so nothing outlives the session: the key prefix for
    ddpkit's own coordination (checkpoint saves, stall reports) and the counter that numbers each
    save or load under it live here, not in module globals. `owns` is True when this session
    created the process group (then `leave` destroys it); a session inside a group someone else
    made (a long-lived pool of ranks) only gets its own prefix.
    """

    def __init__(
        self,
        store: Any,
        prefix: str,
        rank: int,
        limits: Limits,
        *,
        owns: bool,
        watchdog: Watchdog | None = None,
    ) -> None:
        self.store, self.prefix, self.rank, self.limits = store, prefix, rank, limits
        self.owns, self.watchdog = owns, watchdog
        self._counts: dict[str, int] = {}
        self._calls = 0  # the session's tagged calls so far (`agree`)
        self.world_size = int(dist.get_world_size()) if dist.is_initialized() else 1

    def keys(self, what: str) -> str:
        """A fresh key prefix for one coordinated operation ("save", "load"): every rank calls it at
        the same point, so the numbers match."""
        n = self._counts[what] = self._counts.get(what, 0) + 1
        return f"{self.prefix}/{what}/{n}"

    def wait(self, keys: list[str], timeout: float, what: str, *, ranks: tuple[int, ...] = ()) -> list[bytes]:
        """Wait for `keys`; give up early, naming it, if one of `ranks` stops sending heartbeats (its
        process or its node died: in a multi-node or elastic job nothing else would notice for `timeout`)."""
        beats = {r: self.watchdog.heartbeat_key(r) for r in ranks} if self.watchdog is not None else {}
        return wait_for_keys(self.store, keys, timeout, what, heartbeats=beats)

    def agree(self, call: str, *, patient: bool, limit: float | None = None) -> None:
        """Tag this rank's next call of the session's collectives (`call`: "s.save") in the store and
        wait until every rank has tagged the same number; refuse, naming both calls, when they differ.

        A rank that never tags it (it went on, past an `if s.is_main:`, into the next step's backward) is
        found by the watchdog's positions: in a collective at the same place twice, a second apart, it
        cannot come (its collective waits for this rank). Then this rank refuses and leaves the verdict in
        the store, which that rank's watchdog prints and its failure repeats. `patient` (a save, load or
        export) waits for a rank that is only running until `limit` (the save limit); otherwise (a
        script's s.all_reduce, s.gather, s.any_rank, ...) such a rank lets the call go on into its
        collective after a second or two, where the collective limit and its stall report apply as before.
        A rank that has left its session (`leave`) cannot come either: refused at once, naming the line its
        session ended at. A rank whose watchdog gives no answer (its process or its host is gone) is left to
        the collective (a script's call: gloo sees the reset connection at once) or, for a save, load or
        export, to their own waits once it has been silent for SILENT_AFTER (their heartbeats name it)."""
        self._calls += 1
        n, where = self._calls, _user_line()
        base = f"{self.prefix}/call/{n}"
        self.store.set(f"{base}/{self.rank}", json.dumps([call, where]))
        if n > 2:  # every rank has passed call n-1's collective, so none reads call n-2's tag again
            self.store.delete_key(f"{self.prefix}/call/{n - 2}/{self.rank}")  # per-step tags do not pile up
        waiting = {r: f"{base}/{r}" for r in range(self.world_size) if r != self.rank}
        start, delay, seen = time.monotonic(), 0.0002, {}
        end = start + (limit if limit is not None else self.limits.save)
        last: dict[int, str] = {}  # a missing rank -> its position at the previous look
        looked, silent_since = start, None  # when a waited rank first gave no answer
        while waiting:
            for r, key in list(waiting.items()):
                if self.store.check([key]):
                    seen[r] = json.loads(self.store.get(key))
                    del waiting[r]
                    if seen[r][0] != call:
                        self._refuse(call, where, n, f"rank {r} called {seen[r][0]} at {seen[r][1]}", [r])
            if not waiting:
                return
            now = time.monotonic()
            if now > end:
                raise problem(
                    f"gave up after {now - start:.0f} s waiting for {_ranks(waiting)} to reach {call} "
                    f"(rank {self.rank} called it at {where})",
                    f"Call {call} on every rank at the same point; if they were only slow, raise "
                    "save_timeout= in ddpkit.session(...)",
                )
            look = now - start > GRACE and now - looked >= 1.0
            if look and (gone := self._left(waiting)):
                self._refuse(call, where, n, "; ".join(gone.values()), list(gone))
            if isinstance(self.watchdog, CallWatchdog) and look:
                looked = now
                stuck, running, silent = self._positions(call, where, waiting, last)
                if stuck:
                    self._refuse(call, where, n, "; ".join(stuck.values()), list(stuck))
                if running and not patient:
                    return  # only slow: the collective's own limit and its stall report take over
                silent_since = (silent_since or now) if silent else None
                if silent_since is not None and (not patient or now - silent_since > SILENT_AFTER):
                    return  # gone, not elsewhere: what follows fails on its own, naming the lost rank
            elif self.watchdog is None and not patient and now - start > GRACE:
                return
            elif look:
                looked = now
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def _left(self, waiting: dict[int, str]) -> dict[int, str]:
        """The ranks waited for that have ended their session (`leave` says where): they cannot come."""
        keys = {r: f"{self.prefix}/left/{r}" for r in waiting}
        ended = {r: self.store.get(key).decode() for r, key in keys.items() if self.store.check([key])}
        return {
            r: f"rank {r} had left its session (its `with ddpkit.session(...)` ended at {line})"
            for r, line in ended.items()
        }

    def _positions(
        self, call: str, where: str, waiting: dict[int, str], last: dict[int, str]
    ) -> tuple[dict[int, str], bool, bool]:
        """Where each rank that has not tagged the call stands: those in a collective at the same place
        as at the previous look (they cannot come), whether any is still running, and whether any gave no
        answer at all (its process, or its host, is gone)."""
        assert isinstance(self.watchdog, CallWatchdog)  # `join` makes this one
        at = where.split(" in ")[0].rsplit("/", 1)[-1]
        mine = {"state": f"in {call}", "collective": False, "where": where, "at": at}
        answers = self.watchdog.gather_answers(mine, deadline=3 * self.watchdog.poll + 2)
        stuck, running, silent = {}, False, False
        for r in waiting:
            a = answers.get(r)
            if a is None:
                silent = True
                continue
            spot = f"{a['state']} at {a['where']}"
            if a.get("collective") and last.get(r) == spot:
                stuck[r] = f"rank {r} is {spot}"
            running = running or not a.get("collective")
            last[r] = spot
        return stuck, running, silent

    def _refuse(self, call: str, where: str, n: int, others: str, ranks: list[int]) -> None:
        """One paragraph on this rank; the same left in the store for the ranks named (their watchdog
        prints it, their failure repeats it), waited for briefly so it is seen before this rank ends."""
        err = problem(
            f"rank {self.rank} called {call} at {where}, but {others}: the ranks parted at the session's "
            f"collective call {n} (s.save, s.load, s.export and the collectives s.all_reduce, s.gather, "
            "s.any_rank, s.barrier, ... are called by every rank, in the same order)",
            f"Call {call} on every rank at the same point, outside `if s.is_main:` or `if rank == 0:` "
            "(rank 0 writes the shared files itself; s.print prints once)",
        )
        if isinstance(self.watchdog, CallWatchdog):
            self.watchdog.verdict = str(err)  # said here: this rank's own watchdog need not print it
        if self.store.add(f"{self.prefix}/call/verdicts", 1) == 1:
            self.store.set(f"{self.prefix}/call/verdict", str(err))
            peers = dict.fromkeys((r for r in range(self.world_size) if r != self.rank), "")
            gone = self._left(peers)  # named or not, every rank still here reads it before this one ends:
            beats = [f"{self.prefix}/call/verdict/seen/{r}" for r in peers if r not in gone]  # else the
            # backend's error (this rank's end breaks their collective) would speak first
            if self.watchdog is not None:  # seconds at most: each watchdog polls every `poll`
                end = time.monotonic() + 4 * self.watchdog.poll + 2
                while time.monotonic() < end and not self.store.check(beats):
                    time.sleep(0.05)
        raise err

    def leave(self) -> None:
        """Stop the watchdog and, if this session created it, destroy the group; after a success,
        guard the exit (`ddpkit.cluster.exit_guard`). First it leaves word in the store, with the line the
        session ended at: a rank still waiting at a tagged call (`agree`) for this one is refused by name at
        once, instead of waiting out the save limit."""
        with contextlib.suppress(Exception):  # the store may be gone with the job: nothing to tell then
            self.store.set(f"{self.prefix}/left/{self.rank}", _user_line())
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
        if self.owns and dist.is_initialized():
            dist.destroy_process_group()
            if not failures.failure_seen():
                exit_guard.arm()
        self.owns = False


def join(plan: Placement, limits: Limits) -> Membership | None:
    """Join (or, in a group made by someone else, enter) the default process group for `plan`.

    None for one process. Every rank calls it at the same point of the program, since the key
    prefix comes from a counter in the store.
    """
    if not plan.distributed:
        return None
    owns = not dist.is_initialized()
    if owns:
        try:
            _init_group(plan, limits)
        except dist.DistError as err:  # the meeting ran out of time: who never came, where, the fix
            r = plan.ranks
            where = f"{r.master_addr}:{r.master_port}"
            raise rendezvous_report.explain(
                err, rank=r.rank, world_size=r.world_size, address=where, timeout=limits.rendezvous
            ) from None
    store = dist.distributed_c10d._get_default_store()
    joined = int(store.add("ddpkit/groups", 1))
    prefix = f"ddpkit/{(joined - 1) // dist.get_world_size()}"
    watchdog = None
    if owns:
        warn_after = max(limits.collective * 0.8, limits.collective - 60)
        watchdog = CallWatchdog(store, prefix, plan.ranks.rank, plan.ranks.world_size, warn_after=warn_after)
        watchdog.start()
    return Membership(store, prefix, plan.ranks.rank, limits, owns=owns, watchdog=watchdog)


def _init_group(plan: Placement, limits: Limits) -> None:
    r = plan.ranks
    init_method = "env://" if r.launcher == "torchrun" else f"tcp://{r.master_addr}:{r.master_port}"
    store, _, _ = next(
        dist.rendezvous(init_method, r.rank, r.world_size, timeout=timedelta(seconds=limits.rendezvous))
    )
    attempt = _attempt() if r.launcher == "torchrun" else "0"
    dist.init_process_group(
        backend=plan.backend,
        store=dist.PrefixStore(f"ddpkit/attempt-{attempt}", store),
        rank=r.rank,
        world_size=r.world_size,
        timeout=timedelta(seconds=limits.rendezvous),  # the meeting: store waits and connections
    )
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=limits.collective))  # then every collective


def _attempt() -> str:
    """The store prefix's attempt under torchrun: one name for every rank of the round.

    When the agent shares its store with the workers (TORCHELASTIC_USE_AGENT_STORE=True: one node, or
    nodes with fixed node ranks), that store outlives a restart: without a prefix per attempt, a restarted
    rank can read the address a dead rank published and fail to connect ("Connection refused"). The
    restart count is no round number across nodes, though: an agent counts a restart when its worker
    failed, not when it restarts healthy workers for another node (a failure there, or a joining node).
    So nodes meeting through the c10d rendezvous (`ddpkit run --nnodes N` or `MIN:MAX` without node ranks
    sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) get a fresh store each round, hosted by its rank 0 on a
    fresh port, and one prefix: under two they never met (a hang until rendezvous_timeout;
    tests/test_elastic.py, a lost host then a joining host, and tests/test_launch.py, a rank failing on one
    of two nodes)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return "0"  # a store of this round's own
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


# Seconds a tagged call waits for the others' tags before it asks where they stand: a step's worth.
GRACE = 1.0


_CONTEXTLIB = (
    contextlib.__file__
)  # `with ddpkit.session(...)` ends inside its generator: not the script's line


def _user_line() -> str:
    """The script's line that made the call: the innermost frame outside ddpkit, torch and contextlib
    (cheap: a walk of frame objects, no source read but the one line)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith((_DDPKIT_DIR, _TORCH_DIR, _CONTEXTLIB)):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return "?"
    path, line = frame.f_code.co_filename, frame.f_lineno
    return f"{os.path.basename(path)}:{line}: {linecache.getline(path, line).strip()}"


def called_from_ddpkit(depth: int = 2) -> bool:
    """True when the caller's caller is ddpkit's own code (fit's per-step agreement): not tagged."""
    return sys._getframe(depth).f_code.co_filename.startswith(_DDPKIT_DIR)


class CallWatchdog(Watchdog):
    """The watchdog, also reading a verdict another rank left at a tagged call (`Membership.agree`):
    printed once on this rank, which may wait in a collective that can no longer complete, and kept
    for its failure (`on_failure`) to raise instead of the backend's error."""

    verdict: str | None = None

    def _answer_requests(self) -> None:
        super()._answer_requests()
        key = f"{self.prefix}/call/verdict"
        if self.verdict is None and self.store.check([key]):
            self.verdict = self.store.get(key).decode()
            self.store.set(f"{key}/seen/{self.rank}", "1")
            print(f"ddpkit: rank {self.rank}: {self.verdict}", file=sys.stderr, flush=True)

    def gather_answers(self, mine: dict[str, Any], deadline: float) -> dict[int, dict[str, Any]]:
        """Every rank's position (as `gather`, unformatted)."""
        n = int(self.store.add(f"{self.prefix}/where/count", 1))
        self.store.set(f"{self.prefix}/where/request", str(n))
        self._publish(n, mine)
        answers: dict[int, dict[str, Any]] = {}
        end = time.monotonic() + deadline
        while len(answers) < self.world_size and time.monotonic() < end:
            for r in range(self.world_size):
                key = f"{self.prefix}/where/{r}"
                if r not in answers and self.store.check([key]):
                    answer = json.loads(self.store.get(key).decode())
                    if answer["n"] >= n:
                        answers[r] = answer
            time.sleep(0.05)
        return answers


# Seconds without a heartbeat from a rank that is waited for: it is gone. Generous, because a
# watchdog thread cannot beat while its main thread holds the GIL (a big safetensors save_file).
SILENT_AFTER = 60.0


def wait_for_keys(
    store: Any,
    keys: list[str],
    timeout: float,
    what: str,
    *,
    heartbeats: Mapping[int, str] | None = None,
    silent_after: float = SILENT_AFTER,
) -> list[bytes]:
    """Poll the store until every key is set; non-blocking calls, so the watchdog can share the store.

    `heartbeats`: rank -> its watchdog's counter key; a rank whose counter stays still for
    SILENT_AFTER seconds is gone (SIGKILLed, its node lost), and waiting on is pointless."""
    end = time.monotonic() + timeout
    delay = 0.005
    alive = {r: (b"", time.monotonic()) for r in (heartbeats or {})}
    checked = time.monotonic()
    while not store.check(keys):
        now = time.monotonic()
        if heartbeats and now - checked > 1.0:
            checked = now
            for r, key in heartbeats.items():
                beat = store.get(key) if store.check([key]) else b""
                if beat != alive[r][0]:
                    alive[r] = (beat, now)
                elif now - alive[r][1] > silent_after:
                    raise problem(
                        f"rank {r} stopped answering while this rank waited for {what}: no heartbeat for "
                        f"{silent_after:.0f} s (its process or its node is gone)",
                        "Look at that rank's own output or host; under ddpkit run --nnodes MIN:MAX the "
                        "survivors restart and resume from the newest checkpoint",
                    )
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


def on_failure(exc: BaseException, rank: int, group: Membership | None) -> None:
    """Record a failure for `ddpkit run`; when a collective failed, raise a report of every rank."""
    verdict = _verdict(group) if group is not None and not isinstance(exc, DdpkitError) else None
    if verdict is not None:  # a peer named the calls that parted
        err = DdpkitError(f"rank {rank}: {verdict}")
        failures.record_failure(err, rank, user_error=True)
        failures.hush(err)
        raise err from exc
    mistake = isinstance(exc, DdpkitError)  # the user's to fix: one paragraph, no traceback per rank
    failures.record_failure(exc, rank, user_error=mistake)
    if mistake:
        failures.hush(exc)
    watchdog = group.watchdog if group is not None else None
    if watchdog is None or not _collective_failed(exc):
        return
    try:
        mine = exception_position(exc)
        report = watchdog.gather(mine, deadline=min(10.0, 3 * watchdog.poll + 2))
    except Exception:
        return  # reporting must never hide the original error
    limit = group.limits.collective  # type: ignore[union-attr]
    culprit = f"{report.headline}\n" if report.headline else ""  # first: who stalled the others, where
    err = DdpkitError(
        f"{culprit}rank {rank}: a collective failed ({mine['state']} at {mine['where']}): "
        f"{str(exc).strip()[:300]}\n{report.ranks}\nFix the rank(s) named above; if they were only slow, "
        f"raise timeout= in ddpkit.session(...) (now {limit:.0f} s)."
    )
    err._ddpkit_time = failures.raised_at(exc)  # type: ignore[attr-defined]
    failures.record_failure(err, rank, when=failures.raised_at(exc), stalled=report.headline)
    raise err from exc


def _verdict(group: Membership) -> str | None:
    """The verdict a peer left at a tagged call: as this rank's watchdog read it, or else from the store
    itself (a starved watchdog thread may not have polled before the peer's end broke this rank's
    collective); None when there is none, or no store left to ask."""
    verdict = getattr(group.watchdog, "verdict", None)
    if verdict is None:
        key = f"{group.prefix}/call/verdict"
        with contextlib.suppress(Exception):
            verdict = group.store.get(key).decode() if group.store.check([key]) else None
        if verdict is not None:  # said on this rank too, as its watchdog would have
            print(f"ddpkit: rank {group.rank}: {verdict}", file=sys.stderr, flush=True)
    return verdict


def _ranks(ranks: Any) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(str(r) for r in ranks)


def _collective_failed(exc: BaseException) -> bool:
    """A timeout: some rank did not come. (A peer that died has its own error; ddpkit run shows it.)"""
    return isinstance(exc, RuntimeError) and ("Timed out" in str(exc) or "timed out" in str(exc))
