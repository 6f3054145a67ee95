"""The optimizer state of a sharded step, gathered behind training rather than on its path.

    share = local_share(optimizer, fresh, to_cpu)    # main thread, every rank: its share, copied
    full = sharding.gather_state(share, rank, world, group)   # writer thread: whole on rank 0

A sharded step (`ddpkit.step.sharding`) keeps each parameter's optimizer state on its owner only, and a
checkpoint holds the whole state. A synchronous save gathers it in the call (`sharding.gather_state`,
training waits); a background save only copies this rank's share here, and the writer thread
gathers it with the same function over a process group of its own (collectives on training's group
from a second thread could interleave with training's), so rank 0 writes the same files.
"""

from __future__ import annotations

import copy
from typing import Any

import torch


def local_share(optimizer: torch.optim.Optimizer, fresh: set[int], to_cpu: Any) -> dict[str, Any]:
    """This rank's `optimizer.state_dict()`, its tensors copied to CPU memory (training goes on)."""
    own = optimizer.state_dict()
    state = {}
    for index, entries in own["state"].items():
        moved = to_cpu(entries, fresh)
        state[index] = {
            k: v.clone() if isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() not in fresh else v
            for k, v in moved.items()
        }
    return {"state": state, "param_groups": copy.deepcopy(own["param_groups"])}
