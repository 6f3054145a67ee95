"""Keep big CPU tensors' memory from step to step, for models big enough to gain from it, and only those.

Why: glibc's malloc serves every block above 32 MiB (its largest mmap threshold) with a fresh `mmap` and
hands it back to the kernel on `free`. A model with 64 MB weight matrices therefore page-faults (and the
kernel zeroes) every such gradient, activation and optimizer temporary again at every step, 4 KB at a
time: on the `mlp` workload, one process, 1.45 million page faults and 3.3 s of system time in 11 steps.
Two settings remove most of it:

- malloc keeps freed memory for reuse (`M_MMAP_MAX=0`, `M_TRIM_THRESHOLD=1 GiB`), so a step reuses the
  blocks of the step before;
- torch backs its blocks of 2 MB and more with transparent huge pages (`THP_MEM_ALLOC_ENABLE=1`), so
  the faults that remain map 2 MB each and big matrices need fewer TLB entries.

Measured on `mlp`, 2 ranks x 1 thread: 722 ms per step with neither, 574 with malloc's alone, 477 with
both. But huge pages are not free (measured on this project's 2-core virtual machine): the
first touch of a huge page costs 2.8 ms per MB against 0.4 for 4 KB pages (the host backs the guest's
fresh 2 MB frames lazily), which put +1.2-1.4 s on the MLP's start-up (model build, DDP's buckets,
the optimizer state); and on a small model they only cost memory. So, decided per process and model:

- at a CPU session's start (`prepare`), only when DDPKIT_CPU_ALLOCATOR=hugepages asks for huge pages:
  torch is asked for 2 MB-aligned big blocks (THP_MEM_ALLOC_ENABLE=1, read at the process's first
  tensor, so `ddpkit run` also puts it in the ranks' environment) and a big model keeps huge pages
  (~10 % faster MLP steps, a slower start). By default nothing is aligned (the alignment alone raised
  the peak RSS of `gpt` and `bn` by 7-8 % over plain DDP), and where the user set
  THP_MEM_ALLOC_ENABLE=1 without asking for huge pages, they are switched off for this process
  (`prctl(PR_SET_THP_DISABLE)`, when the kernel gives them only on request);
- in `s.model` (`fit_to`), a parameter of 32 MiB or more: keep memory (mallopt above);
- otherwise: glibc serves every block below 32 MiB from its heap from the first step on, and keeps the
  heap's top instead of handing it back (`M_MMAP_THRESHOLD` 32 MiB, `M_TRIM_THRESHOLD` 1 GiB). Blocks
  of 32 MiB and more keep glibc's behaviour.

Why the heap's top: with glibc's defaults, whether a small model's step frees its
activations at the top of the heap, which glibc then returns (trim threshold: twice the largest block
freed so far, ~1 MB for the `cnn`), depends on where longer-lived objects happened to land. When they
do, the next step faults them in again: measured on `cnn` (2 ranks, benchmarks/step_profile.py), runs
alternate between ~1 and 150-800 page faults per step, and a faulting step costs +1.2-1.4 ms of CPU on
a 5.5 ms step. Plain DDP has the same lottery; keeping the top removes it (0-1 faults per step after the
first 3) and leaves resident only memory the step already used.

Linux with glibc only; elsewhere nothing changes. Opt out with DDPKIT_CPU_ALLOCATOR=default.
"""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from ddpkit.names import CPU_ALLOCATOR_ENV

if TYPE_CHECKING:
    import torch

OPT_OUT = CPU_ALLOCATOR_ENV
HUGE_PAGES = "hugepages"  # DDPKIT_CPU_ALLOCATOR=hugepages: huge pages for big models (opt-in, see above)
KEEP_FROM_BYTES = 32 << 20  # glibc's largest mmap threshold: blocks this big are mmapped, faulted every step
_M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
_KEEP_BYTES = 1 << 30
_PR_SET_THP_DISABLE = 41  # <linux/prctl.h>
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"

# Process-wide settings mirrored here (they outlive sessions by nature, like the process's malloc):
_applied = False  # mallopt is one-way: applied once


def _glibc() -> bool:
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def enabled(env: Mapping[str, str] | None = None) -> bool:
    """True unless opted out (DDPKIT_CPU_ALLOCATOR=default) or not Linux/glibc."""
    env = os.environ if env is None else env
    return env.get(OPT_OUT, "").lower() not in ("default", "0", "off") and _glibc()


def rank_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Variables for a rank's environment, read by torch at its first tensor; user values win.

    Only when huge pages are asked for (DDPKIT_CPU_ALLOCATOR=hugepages): torch's 2 MB-aligned blocks
    are what huge pages need, and they must be asked for before any tensor exists. Without huge pages
    the alignment buys nothing and costs memory (peak RSS +8 % on `gpt`, +7 % on `bn` against
    plain DDP, whose ranks do not align). Keeping memory is decided later, per model (`fit_to`)."""
    env = os.environ if env is None else env
    if not enabled(env) or not huge_pages_wanted(env) or "THP_MEM_ALLOC_ENABLE" in env:
        return {}
    return {"THP_MEM_ALLOC_ENABLE": "1"}


def prepare() -> None:
    """At a CPU session's start: torch's page-aligned big blocks (effective if no tensor was made yet),
    and no huge pages from here on unless asked for (DDPKIT_CPU_ALLOCATOR=hugepages; see the docstring)."""
    if enabled():
        os.environ.update(rank_env())
        if not huge_pages_wanted() and os.environ.get("THP_MEM_ALLOC_ENABLE") == "1" and _thp_on_request():
            _huge_pages(False)


def huge_pages_wanted(env: Mapping[str, str] | None = None) -> bool:
    """True when the user asked for huge pages for big models (DDPKIT_CPU_ALLOCATOR=hugepages)."""
    env = os.environ if env is None else env
    return env.get(OPT_OUT, "").lower() == HUGE_PAGES and _glibc()


def worthwhile(tensors: Iterable[torch.Tensor], threshold: int = KEEP_FROM_BYTES) -> bool:
    """True when some tensor is big enough for glibc to map and unmap it at every step (>= 32 MiB)."""
    return any(t.numel() * t.element_size() >= threshold for t in tensors)


def fit_to(module: torch.nn.Module) -> str:
    """Decide for the model about to be trained: "kept" (memory kept; huge pages if asked for), "heap"
    (blocks below 32 MiB from a heap that is not trimmed, no huge pages) or "off" (opted out / not glibc)."""
    if not enabled():
        return "off"
    if worthwhile(module.parameters()):
        apply()
        if huge_pages_wanted() and huge_pages_disabled():  # off since the session's start, or inherited
            _huge_pages(True)
        return "kept"
    if not _applied and os.environ.get("THP_MEM_ALLOC_ENABLE") == "1" and _thp_on_request():
        _huge_pages(False)  # only torch's requests would have given them: stop those
    if not _applied:
        _keep_heap_top()
    return "heap"


def _keep_heap_top() -> bool:
    """Blocks below 32 MiB from the heap, whose top is kept (see the module docstring); the environment's
    MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ win. True if glibc took both."""
    env = os.environ
    try:
        libc = ctypes.CDLL(None)
        mmap = int(env.get("MALLOC_MMAP_THRESHOLD_", KEEP_FROM_BYTES))
        trim = int(env.get("MALLOC_TRIM_THRESHOLD_", _KEEP_BYTES))
        return (libc.mallopt(_M_MMAP_THRESHOLD, mmap) == 1) & (libc.mallopt(_M_TRIM_THRESHOLD, trim) == 1)
    except (OSError, AttributeError, ValueError):
        return False


def apply() -> bool:
    """Keep freed memory in this running process from now on (idempotent); True when in effect.

    The environment's values win (glibc read them at start; repeating them changes nothing)."""
    global _applied
    if _applied:
        return True
    if not enabled():
        return False
    os.environ.update(rank_env())  # for a process that has made no tensor yet
    env = os.environ
    try:
        libc = ctypes.CDLL(None)
        ok = libc.mallopt(_M_MMAP_MAX, int(env.get("MALLOC_MMAP_MAX_", 0))) == 1
        ok = libc.mallopt(_M_TRIM_THRESHOLD, int(env.get("MALLOC_TRIM_THRESHOLD_", _KEEP_BYTES))) == 1 and ok
    except (OSError, AttributeError, ValueError):
        ok = False
    _applied = ok
    return ok


def _thp_on_request() -> bool:
    """True when the kernel gives huge pages only to memory that asks for them ("madvise" mode)."""
    try:
        with open(_THP_MODE) as f:
            return "[madvise]" in f.read()
    except OSError:
        return False


def _huge_pages(allowed: bool) -> bool:
    """Allow or forbid transparent huge pages for this process's new page faults; True if done."""
    try:
        return ctypes.CDLL(None).prctl(_PR_SET_THP_DISABLE, 0 if allowed else 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def huge_pages_disabled() -> bool:
    """Whether this process's huge pages are switched off (PR_GET_THP_DISABLE), for tests and doctor."""
    try:
        return ctypes.CDLL(None).prctl(_PR_SET_THP_DISABLE + 1, 0, 0, 0, 0) == 1
    except (OSError, AttributeError):
        return False


RETURN_FROM_BYTES = 1 << 20  # FSDP on CPU: blocks this big go back to the kernel when freed


def return_freed_blocks() -> bool:
    """FSDP on CPU ranks: serve every block of 1 MiB or more with its own mmap, returned on free.

    A rank's FSDP step allocates and frees the same big temporaries for every block (the all-gathered
    parameters, their copy-out, the unsharded gradients, the reduce-scatter input); glibc's default
    raises its mmap threshold to 32 MiB after the first such free and then keeps the 16-32 MiB pieces
    in its heap, fragmented: measured on `mlp` at 4 ranks, peak RSS 791-903 MiB per rank with glibc's
    default, 654-657 with this (step 1.80 vs 1.97 s, within noise on a shared machine). The peak then
    follows the live tensors, which is what sharding is for. Process-wide and one-way, like
    `apply`; skipped where that is opted out (DDPKIT_CPU_ALLOCATOR=default) or not glibc.
    """
    if not enabled():
        return False
    try:
        return ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, RETURN_FROM_BYTES) == 1
    except (OSError, AttributeError):
        return False
