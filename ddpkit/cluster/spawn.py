"""Run a function on N local ranks from Python (notebooks, tests): `ddpkit.spawn(fn, nproc=2)`.

Each rank gets torchrun's environment contract (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT), so
`ddpkit.session()` and plain `init_process_group()` work inside `fn` unchanged. The parent hosts the
rendezvous TCPStore on a port the OS picks, exactly as torchrun's agent does, so concurrent spawns
never race for a port.

How the ranks start (`start_method="auto"`):
- "spawn" (new interpreters) for a function importable by name (module level of a .py file);
- "fork" for one that is not: a function defined in a notebook cell, a lambda, a nested function,
  as Accelerate's `notebook_launcher` does. Forking is safe only when the parent has not initialised
  CUDA (a clear error otherwise) and each rank uses one CPU thread: GNU OpenMP hangs a forked child
  that runs a parallel region with more threads after the parent used its pool (seen here: 2 threads
  hang, 1 does not), so forked ranks get 1 thread and `threads > 1` is refused with the fix.

`start_method="forkserver"` (asked for, never chosen by "auto") forks each rank from Python's forkserver,
which imported torch, torch._dynamo and ddpkit once for this process's life: a new interpreter pays those
imports for every rank (~5 s of CPU each on a 2-core VM), a forked rank ~0.1 s. What torch and the C
libraries read as they load (ATEN_*, OMP_*, MALLOC_*, ...; `ddpkit.cluster.warmstart.LOAD_TIME`) is the
server's, so a call whose environment differs there starts new interpreters instead. Not the default: in
one long test session a rank forked this way hung (the suite's trace test, once in ~1000 tests), cause
not found.
"""

from __future__ import annotations

import os
import pickle
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp
from torch.distributed import TCPStore

from ddpkit.cluster.failures import raised_at
from ddpkit.cluster.rank_output import line_buffered
from ddpkit.cluster.topology import Hardware, threads_per_process
from ddpkit.cluster.warmstart import PRELOAD, load_time_env
from ddpkit.errors import problem


class SpawnError(RuntimeError):
    """A rank raised, died or timed out; the message starts with the first failing rank."""


def _rank_main(
    local_rank: int,
    fn: Callable[..., Any],
    args: Sequence[Any],
    env: dict[str, str],
    results: Any,
) -> None:
    os.environ.clear()  # a rank forked from the server has the server's: this call's replaces it
    os.environ.update(env)
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank))
    line_buffered()  # the ranks share the parent's stdout: one write a line (rank_output)
    import torch

    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    try:
        # Pickled by value: torch's queue would send tensors as shared-memory handles that vanish
        # when this process exits before the parent reads them.
        results.put((local_rank, True, pickle.dumps(fn(*args)), time.time()))
    except BaseException as exc:  # report every failure to the parent, then die non-zero
        text = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        results.put((local_rank, False, text, raised_at(exc)))
        raise SystemExit(1) from None


def spawn(
    fn: Callable[..., Any],
    nproc: int = 2,
    args: Sequence[Any] = (),
    *,
    timeout: float = 300.0,
    threads: int | None = None,
    env: Mapping[str, str] | None = None,
    start_method: str = "auto",
) -> list[Any]:
    """Run `fn(*args)` on `nproc` local ranks; return the per-rank results, in rank order.

    If any rank raises, exits or exceeds `timeout` seconds, the others are terminated and
    `SpawnError` names the first failing rank with its traceback. `threads` per rank defaults to
    the CPU cores split evenly (OMP_NUM_THREADS, when set, wins; 1 for forked ranks); `env` adds
    variables to the ranks' environment. `start_method`: "auto", "spawn", "fork" or "forkserver" (module
    docstring).
    """
    if nproc < 1:
        raise problem(f"nproc={nproc} is below 1", "Pass nproc=1 or more")
    method = _start_method(fn, start_method, threads, {**os.environ, **(env or {})})
    store = TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout)
    )
    n_threads = (
        1
        if method == "fork"
        else threads
        or int(os.environ.get("OMP_NUM_THREADS") or threads_per_process(Hardware.detect().cpu_cores, nproc))
    )
    rank_env = {
        **os.environ,
        **(env or {}),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",  # ranks connect to the store this process hosts
        "OMP_NUM_THREADS": str(n_threads),
    }
    results = mp.get_context(method).SimpleQueue()
    procs = mp.start_processes(
        _rank_main, args=(fn, tuple(args), rank_env, results), nprocs=nproc, join=False, start_method=method
    )
    try:
        return _collect(procs, results, nproc, timeout)
    finally:
        for p in procs.processes:
            if p.is_alive():
                p.terminate()
        for p in procs.processes:
            p.join(5)
            if p.is_alive():
                p.kill()
        del store


def importable(fn: Callable[..., Any]) -> bool:
    """Whether a new interpreter can import `fn` by name (what the "spawn" start method needs)."""
    if getattr(fn, "__name__", "") == "<lambda>" or "<locals>" in getattr(fn, "__qualname__", ""):
        return False
    module = sys.modules.get(getattr(fn, "__module__", "") or "")
    return module is not None and (fn.__module__ != "__main__" or hasattr(module, "__file__"))


def _start_method(fn: Callable[..., Any], asked: str, threads: int | None, env: Mapping[str, str]) -> str:
    if asked not in ("auto", "forkserver", "spawn", "fork"):
        raise problem(
            f"start_method={asked!r} is not 'auto', 'forkserver', 'spawn' or 'fork'", "Pass one of those"
        )
    method = asked if asked != "auto" else ("spawn" if importable(fn) else "fork")
    if method == "forkserver" and not _warm_server_current(env):
        method = "spawn"
    if method in ("spawn", "forkserver") and not importable(fn):
        raise problem(
            f"{fn!r} cannot be sent to new interpreters (a lambda, a nested function, or one defined in "
            "a notebook cell is not importable by name)",
            "Pass start_method='auto' (forks for such functions), or define it at the top level of a .py "
            "module",
        )
    if method != "fork":
        return method
    if "fork" not in mp.get_all_start_methods():
        raise problem(
            f"{fn!r} needs the fork start method, which this platform lacks",
            "Define the function at the top level of a .py module and pass that",
        )
    import torch

    if torch.cuda.is_initialized():
        raise problem(
            "CUDA is already initialised in this process (a cell ran CUDA code before ddpkit.spawn), and "
            "forked ranks cannot use it",
            "Restart the kernel and call ddpkit.spawn before any CUDA work in the notebook, or define the "
            "function in a .py module (started with 'spawn')",
        )
    if threads is not None and threads > 1:
        raise problem(
            f"threads={threads} with forked ranks: GNU OpenMP hangs a forked child that runs more than one "
            "thread after the parent used its thread pool",
            "Leave threads unset (forked ranks use 1), or define the function in a .py module for more "
            "threads",
        )
    return method


_server_env: dict[str, str] | None = None  # the load-time variables the forkserver started with


def _warm_server_current(env: Mapping[str, str]) -> bool:
    """Whether ranks may be forked from the server: it exists on this platform and started (or will
    start now) with this environment's load-time variables."""
    global _server_env
    if "forkserver" not in mp.get_all_start_methods():
        return False
    if _server_env is None:
        mp.get_context("forkserver").set_forkserver_preload(list(PRELOAD))
        _server_env = load_time_env(os.environ)
    return _server_env == load_time_env(env)


def _collect(procs: Any, results: Any, nproc: int, timeout: float) -> list[Any]:
    values: dict[int, Any] = {}
    failures: list[tuple[float, int, str]] = []
    deadline = time.monotonic() + timeout
    while len(values) < nproc:
        while not results.empty():
            rank, ok, value, when = results.get()
            if ok:
                values[rank] = pickle.loads(value)
            else:
                failures.append((when, rank, value))
        if failures:
            # Peers of a failing rank fail moments later in a collective; name the one that was first.
            time.sleep(0.5)
            while not results.empty():
                rank, ok, value, when = results.get()
                if not ok:
                    failures.append((when, rank, value))
            _, rank, text = min(failures)
            raise SpawnError(f"rank {rank} of {nproc} failed:\n{text}")
        for rank, p in enumerate(procs.processes):
            if rank not in values and not p.is_alive() and results.empty():
                raise SpawnError(f"rank {rank} of {nproc} died with exit code {p.exitcode} before returning")
        if time.monotonic() > deadline:
            missing = sorted(set(range(nproc)) - set(values))
            raise SpawnError(f"ranks {missing} of {nproc} did not finish within {timeout:.0f} s; terminated")
        time.sleep(0.01)
    return [values[r] for r in range(nproc)]
