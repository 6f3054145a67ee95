"""Keep big CPU tensors' memory from step to step instead of faulting it in again every step.

Why: glibc's malloc serves every block above 32 MiB with a fresh `mmap` and hands it back to the kernel
on `free`. A model with 64 MB weight matrices therefore page-faults (and the kernel zeroes) every such
gradient, activation and optimizer temporary again at every step, 4 KB at a time: on the `mlp`
workload, one process, 1.45 million page faults and 3.3 s of system time in 11 steps. Two settings
remove most of it:

- malloc keeps freed memory for reuse (`M_MMAP_MAX=0`, `M_TRIM_THRESHOLD=1 GiB`), so a step reuses the
  blocks of the step before;
- torch backs its blocks of 2 MB and more with transparent huge pages (`THP_MEM_ALLOC_ENABLE=1`, which
  torch reads at its first large allocation), so the faults that remain map 2 MB each.

Measured on `mlp`, one process x 1 thread: 650 ms -> 403 ms per step, peak RSS 1.04-1.11 GB either way
(docs/performance.md). `ddpkit run` and `ddpkit.spawn` put both in the ranks' environment, which covers
every allocation from the start; a session on the CPU applies them again at start for plain `torchrun`
or `python` (allocations made before then keep the old behaviour). Linux with glibc only; elsewhere
nothing changes. Opt out with DDPKIT_CPU_ALLOCATOR=default.
"""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Mapping

OPT_OUT = "DDPKIT_CPU_ALLOCATOR"
_M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
_M_MMAP_MAX = -4
_KEEP_BYTES = 1 << 30

_applied = False


def _glibc() -> bool:
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def enabled(env: Mapping[str, str] | None = None) -> bool:
    """True unless opted out (DDPKIT_CPU_ALLOCATOR=default) or not Linux/glibc."""
    env = os.environ if env is None else env
    return env.get(OPT_OUT, "").lower() not in ("default", "0", "off") and _glibc()


def rank_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Variables for a rank's environment (read at process start by glibc and torch); user values win."""
    env = os.environ if env is None else env
    if not enabled(env):
        return {}
    wanted = {
        "MALLOC_MMAP_MAX_": "0",
        "MALLOC_TRIM_THRESHOLD_": str(_KEEP_BYTES),
        "THP_MEM_ALLOC_ENABLE": "1",
    }
    return {k: v for k, v in wanted.items() if k not in env}


def apply() -> bool:
    """Apply the settings to this running process (idempotent); True when they are in effect."""
    global _applied
    if _applied:
        return True
    if not enabled():
        return False
    env = os.environ
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # torch reads it at its first allocation >= 2 MB
    try:  # the environment's values win (glibc read them at start; repeating them changes nothing)
        libc = ctypes.CDLL(None)
        ok = libc.mallopt(_M_MMAP_MAX, int(env.get("MALLOC_MMAP_MAX_", 0))) == 1
        ok = libc.mallopt(_M_TRIM_THRESHOLD, int(env.get("MALLOC_TRIM_THRESHOLD_", _KEEP_BYTES))) == 1 and ok
    except (OSError, AttributeError, ValueError):
        ok = False
    _applied = ok
    return ok
