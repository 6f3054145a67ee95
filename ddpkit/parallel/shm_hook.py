"""The shared-memory all-reduce as a DDP communication hook ("shm"; `ddpkit.parallel.comm_hooks`).

    state, hook = shm_hook_factory()          # collective: every rank of the group calls it
    ddp_model.register_comm_hook(state, hook)

A bucket that is not a CPU float tensor, or a state that fell back (`state.reason`), goes through the
default all-reduce hook; the rest is `ShmAllReduce.all_reduce_mean_` (`ddpkit.parallel.shm_allreduce`).
"""

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from ddpkit.parallel.shm_allreduce import FLOATS, ShmAllReduce


def shm_allreduce_hook(state: ShmAllReduce, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket's mean over ranks through shared memory (see module doc)."""
    buffer = bucket.buffer()
    if state.segment is None or buffer.device.type != "cpu" or buffer.dtype not in FLOATS:
        return default_hooks.allreduce_hook(state.group, bucket)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(state.all_reduce_mean_(buffer))
    return fut


def shm_hook_factory(
    process_group: dist.ProcessGroup | None = None, *, chunk_mb: float = 16.0, timeout: float = 600.0
) -> tuple[ShmAllReduce, Callable[[ShmAllReduce, dist.GradBucket], torch.futures.Future[torch.Tensor]]]:
    """`(state, hook)` for `ddp.register_comm_hook(state, hook)`. Collective: call it on every rank."""
    return ShmAllReduce(process_group, chunk_mb=chunk_mb, timeout=timeout), shm_allreduce_hook
