"""A pool of long-lived gloo ranks that many tests share (a new interpreter for a rank costs ~4 s of CPU in
imports; the ranks are forked from a forkserver that made them once: `_context`).

Each worker process joins one process group at start, then runs `fn(*args)` for every request and
sends back the result, tagged with the request's id: `run` drops a result whose id is not the current
request's, so a late answer to a request that timed out is never read as the next one's. `ddpkit.session()` inside `fn` finds the group already initialised and reuses
it (and leaves it alone on exit). A failure or a timeout on any rank kills the whole pool; the next
`run` starts a fresh one, so one broken test cannot poison the next.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp
from torch.distributed import TCPStore


def _die_with_parent() -> None:
    """A worker blocks on its inbox forever: if pytest is killed (CI's timeout, a developer's ^C twice),
    the kernel ends the worker too (Linux's parent-death signal; a forked worker's parent is the forkserver,
    which ends with pytest) instead of leaving it to hold a core."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _serve(rank: int, world: int, port: int, inbox: Any, outbox: Any) -> None:
    _die_with_parent()
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",
        OMP_NUM_THREADS="1",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    outbox.put((READY, rank, True, None))
    while True:
        request = inbox.get()
        if request is None:
            break
        request_id, fn, args = request
        try:
            outbox.put((request_id, rank, True, fn(*args)))
        except BaseException as exc:
            outbox.put((request_id, rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    dist.destroy_process_group()


READY = 0  # the id of the message each worker sends once it has joined the group; requests count from 1
START_TIMEOUT = 180.0  # the pool's start (imports, the group's rendezvous), not counted in any request's


class RankFailure(AssertionError):
    """A rank raised or the pool timed out; carries the rank's traceback."""


def _context() -> Any:
    """Python's forkserver with what a rank imports preloaded (ddpkit's own list, as for
    `ddpkit.spawn(start_method="forkserver")`; one server per pytest process, shared by its pools): a rank is a
    fork instead of a new interpreter importing torch (measured: a 4-rank pool up in ~16 s instead of ~57 s
    on the loaded 2-core VM). A new interpreter where there is no forkserver, or where the server started
    with other load-time variables (`ATEN_CPU_CAPABILITY`, `OMP_*`, ...) than this process has now."""
    from ddpkit.cluster.spawn import _warm_server_current

    return mp.get_context("forkserver" if _warm_server_current(os.environ) else "spawn")


class RankPool:
    def __init__(self, world: int) -> None:
        self.world = world
        self._procs: list[Any] = []
        self.request_id = 0  # every request carries it; a result with another id is stale and dropped
        self.dropped = 0  # stale results seen (a test checks the pool never hands one out)

    def _start(self) -> None:
        ctx = _context()
        self._store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self._inboxes = [ctx.SimpleQueue() for _ in range(self.world)]
        self._outbox = ctx.SimpleQueue()
        self._procs = [
            ctx.Process(target=_serve, args=(r, self.world, self._store.port, self._inboxes[r], self._outbox))
            for r in range(self.world)
        ]
        for p in self._procs:
            p.start()
        # A request's timeout is its own: the workers' start (on a loaded machine, 4 ranks importing and
        # meeting can take longer than a request may) is waited for here, before any request is sent.
        ready: set[int] = set()
        deadline = time.monotonic() + START_TIMEOUT
        while len(ready) < self.world:
            while not self._outbox.empty():
                request_id, rank, _, _ = self._outbox.get()
                assert request_id == READY, request_id
                ready.add(rank)
            dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in ready]
            if (dead and self._outbox.empty()) or time.monotonic() > deadline:
                self.close()
                what = f"rank(s) {dead} died" if dead else f"not ready after {START_TIMEOUT} s"
                raise RankFailure(f"a pool of {self.world} did not start: {what}")
            time.sleep(0.002)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 60.0) -> list[Any]:
        """Run `fn(*args)` on every rank; return the results in rank order."""
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close()
            self._start()
        self.request_id += 1
        for inbox in self._inboxes:
            inbox.put((self.request_id, fn, args))
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(results) < self.world:
            while not self._outbox.empty():
                request_id, rank, ok, value = self._outbox.get()
                if request_id != self.request_id:  # left over from a request that timed out
                    self.dropped += 1
                    continue
                if not ok:
                    self.close()
                    raise RankFailure(f"rank {rank} of {self.world} raised:\n{value}")
                results[rank] = value
            dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in results]
            if dead and self._outbox.empty():
                self.close()
                raise RankFailure(f"rank(s) {dead} of {self.world} died")
            if time.monotonic() > deadline:
                self.close()
                raise RankFailure(
                    f"ranks {sorted(set(range(self.world)) - set(results))} timed out after {timeout} s"
                )
            time.sleep(0.002)
        return [results[r] for r in range(self.world)]

    def close(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        self._procs = []
