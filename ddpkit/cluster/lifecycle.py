"""Joining and leaving the process group: the only calls to init/destroy_process_group.

Kept apart from `Session` so that the failure-handling policy lives in one place:

- three separate time limits (`Limits`): rendezvous, every collective, and a checkpoint save;
- a watchdog per process (`ddpkit.cluster.watchdog`) that turns a timed-out collective into a report of
  where every rank stands;
- keys in the c10d store for ddpkit's own coordination (checkpoint saves, stall reports), polled
  with deadlines so that a slow rank-0 save never trips the collective timeout of the others;
- an exit that cannot turn a finished run into a failure (`ddpkit.cluster.exit_guard`, armed by `leave`).

All of it hangs off one `Membership` per session (`join` returns it); nothing here is module state.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ddpkit.cluster import exit_guard, failures
from ddpkit.cluster.exit_guard import finished_with_zero
from ddpkit.cluster.topology import Placement
from ddpkit.cluster.watchdog import Watchdog, exception_position
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

    def leave(self) -> None:
        """Stop the watchdog and, if this session created it, destroy the group; after a success,
        guard the exit (`ddpkit.cluster.exit_guard`)."""
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
        _init_group(plan, limits)
    store = dist.distributed_c10d._get_default_store()
    joined = int(store.add("ddpkit/groups", 1))
    prefix = f"ddpkit/{(joined - 1) // dist.get_world_size()}"
    watchdog = None
    if owns:
        warn_after = max(limits.collective * 0.8, limits.collective - 60)
        watchdog = Watchdog(store, prefix, plan.ranks.rank, plan.ranks.world_size, warn_after=warn_after)
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


def _collective_failed(exc: BaseException) -> bool:
    """A timeout: some rank did not come. (A peer that died has its own error; ddpkit run shows it.)"""
    return isinstance(exc, RuntimeError) and ("Timed out" in str(exc) or "timed out" in str(exc))
