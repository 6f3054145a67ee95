"""The optimizer state of a sharded step, one route for every save: this rank's share, then gathered.

    share = local_share(optimizer, fresh, to_cpu, copy=background)   # `capture`, every rank
    full = collectives.gather_state(share, rank, world, job.group)   # `write`: whole on rank 0

A sharded step (`ddpkit.step.sharding`) keeps each parameter's optimizer state on its owner only, and a
checkpoint holds the whole state. Every save takes this rank's share in `capture` and gathers it in
`write` with the same function over the save's one group (`write.Job.group`): training's group in a
synchronous save (training waits), the checkpoints' own group on the writer thread in a background
save (collectives on training's group from a second thread could interleave with training's), where
the share is a copy (`copy=True`) so training may go on. Rank 0 writes the same files either way.
"""

from __future__ import annotations

import copy as copying
from typing import Any

import torch


def local_share(
    optimizer: torch.optim.Optimizer, fresh: set[int], to_cpu: Any, *, copy: bool, stage: Any = None
) -> dict[str, Any]:
    """This rank's `optimizer.state_dict()`; with `copy`, its tensors copied to CPU memory (by `stage`
    when given: the writer process's shared memory, reused from one save to the next; else a clone)."""
    own = optimizer.state_dict()
    if not copy:
        return own
    clone = stage if stage is not None else torch.clone
    state = {}
    for index, entries in own["state"].items():
        moved = to_cpu(entries, fresh)
        state[index] = {
            k: clone(v) if isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() not in fresh else v
            for k, v in moved.items()
        }
    return {"state": state, "param_groups": copying.deepcopy(own["param_groups"])}
