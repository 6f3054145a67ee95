"""The memory one rank may use, as the kernel enforces it (a cgroup), and the refusal to replicate a
model whose training state does not fit in it.

    limit = rank_memory.limit_bytes()          # None when no cgroup limits this process
    rank_memory.check_replicated(strategy, module, world)    # s.model: DDP refused, FSDP suggested

A cgroup memory limit (v1 `memory.limit_in_bytes`, v2 `memory.max`, the smallest along the path from
the process's cgroup to the root) is what a container, a Slurm job with `ConstrainRAMSpace` or a
Kubernetes pod gives a rank; past it the kernel's OOM killer ends the process with SIGKILL, mid-step,
with no Python traceback. DDP keeps the whole model state on every rank (parameters, gradients and the
optimizer's state), so when that alone exceeds the limit, no step can finish: say so before wrapping,
with the fix (FSDP keeps 1/N of it). The optimizer is not known yet at `s.model`, so an Adam-like one
(two state tensors per parameter, `choice.optimizer_slots(None)`) is assumed, and said;
DDPKIT_MEMORY_CHECK=off skips the check (e.g. for SGD without momentum, which needs half of that).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from torch import nn

from ddpkit.errors import problem
from ddpkit.names import MEMORY_CHECK_ENV
from ddpkit.strategy.base import Strategy
from ddpkit.strategy.choice import model_state_bytes, optimizer_slots

OPT_OUT = MEMORY_CHECK_ENV
_UNLIMITED = 1 << 60  # v1 reports "no limit" as a huge page-rounded number


def _cgroup_paths(proc_cgroup: str) -> tuple[str | None, str | None]:
    """This process's memory cgroup path under v1 and its unified (v2) path, from /proc/self/cgroup."""
    v1 = v2 = None
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if "memory" in controllers.split(","):
            v1 = path
        elif controllers == "":
            v2 = path
    return v1, v2


def _smallest(root: Path, path: str, name: str) -> int | None:
    """The smallest limit in file `name` along `path` up to the root of the hierarchy at `root`."""
    best = None
    current = root / path.lstrip("/")
    while True:
        try:
            text = (current / name).read_text().strip()
        except OSError:
            text = ""
        if text and text != "max":
            value = int(text)
            if value < _UNLIMITED:
                best = value if best is None else min(best, value)
        if current == root or root not in current.parents:
            return best
        current = current.parent


def limit_bytes(proc_cgroup: str | None = None, mount: Path = Path("/sys/fs/cgroup")) -> int | None:
    """This process's memory limit in bytes (cgroup v1 or v2), or None when nothing limits it."""
    if proc_cgroup is None:
        try:
            proc_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            return None
    v1, v2 = _cgroup_paths(proc_cgroup)
    found = []
    if v1 is not None:
        found.append(_smallest(mount / "memory", v1, "memory.limit_in_bytes"))
    if v2 is not None:
        for root in (mount, mount / "unified"):  # pure v2, or the hybrid layout's unified mount
            if (root / "cgroup.controllers").is_file():
                found.append(_smallest(root, v2, "memory.max"))
    limits = [f for f in found if f is not None]
    return min(limits) if limits else None


def replicated_state_bytes(module: nn.Module, world: int, sharded_step: bool) -> int:
    """What DDP holds per rank: parameters and gradients whole, an Adam-like optimizer's two state
    tensors per parameter whole or, when ddpkit shards the optimizer step, 1/world of them."""
    whole = model_state_bytes(module, slots=0)  # parameters + gradients
    optimizer = model_state_bytes(module, slots=optimizer_slots(None)) - whole
    return whole + (optimizer // world if sharded_step else optimizer)


def check_replicated(
    strategy: Strategy,
    module: nn.Module,
    world: int,
    *,
    sharded_step: bool,
    env: Mapping[str, str] | None = None,
    limit: int | None = None,
) -> None:
    """Refuse a strategy that keeps whole state on each rank when that state exceeds the rank's limit."""
    env = os.environ if env is None else env
    if strategy.shards_state or world < 2 or env.get(OPT_OUT, "").lower() in ("off", "0", "no"):
        return
    limit = limit_bytes() if limit is None else limit
    if limit is None:
        return
    state = replicated_state_bytes(module, world, sharded_step)
    if state <= limit:
        return
    mb = 2**20
    how = f"1/{world} of" if sharded_step else "all of"
    raise problem(
        f"the model state, {state / mb:.0f} MiB per rank (parameters and gradients whole, {how} "
        f"an Adam-like optimizer's 2 state tensors per parameter), exceeds this rank's memory limit of "
        f"{limit / mb:.0f} MiB (its cgroup); {strategy.describe()} keeps a whole replica on each of the "
        f"{world} ranks, so the kernel would kill the rank during the first step",
        f"Pass strategy='fsdp' (about {state / world / mb:.0f} MiB of model state per rank at {world} ranks) "
        "and build the model with s.model(Net) so that no rank holds it whole; or raise the limit; with an "
        f"optimizer that keeps less state, {OPT_OUT}=off skips this check",
    )
