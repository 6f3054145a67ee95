"""Joining and leaving the process group: the only calls to init/destroy_process_group.

Kept apart from `Session` so that the failure-handling policy (timeouts, teardown that lets a finished
run exit 0, reporting which rank failed) lives in one place.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ddpkit.topology import Plan


def join_group(plan: Plan, timeout: float) -> bool:
    """Initialise the default process group for `plan`; return True if this call created it."""
    if not plan.distributed or dist.is_initialized():
        return False
    r = plan.ranks
    kwargs: dict[str, Any] = {}
    if r.launcher != "torchrun":  # torchrun's env:// (and its agent's store) is the default
        kwargs["init_method"] = f"tcp://{r.master_addr}:{r.master_port}"
    dist.init_process_group(
        backend=plan.backend,
        rank=r.rank,
        world_size=r.world_size,
        timeout=timedelta(seconds=timeout),
        **kwargs,
    )
    return True


def leave_group() -> None:
    """Destroy the default process group, if there is one."""
    if dist.is_initialized():
        dist.destroy_process_group()
