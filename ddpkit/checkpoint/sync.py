"""What a checkpoint needs from the session, typed, and how the ranks coordinate a save or a load.

    ctx = CheckpointContext(rank=0, world_size=2, strategy=strategy, optimizers=stepper,
                            group=membership, save_timeout=3600.0, say=s.print, barrier=s.barrier)

The checkpoint layer receives exactly this value (built once by the session at the first save, load
or export, after the session built its strategy), never the session itself nor a call back into it:
the strategy for what the model's state is (a `StateOwner`, `ddpkit.checkpoint.owners`), the stepper
for optimizers whose step is sharded, the layout the manifest records, the group's store for waiting
without a collective. `Sync` is one save's or load's keys in that store,
polled with the save limit (no collective), so a slow rank-0 write never trips the collective timeout
of the others.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ddpkit.checkpoint.owners import OptimizerStates, StateOwner
from ddpkit.cluster.lifecycle import Membership
from ddpkit.errors import problem

if TYPE_CHECKING:
    from ddpkit.parallel.layout import Layout

__all__ = ["CheckpointContext", "OptimizerStates", "StateOwner", "Sync"]


@dataclass(frozen=True, kw_only=True)
class CheckpointContext:
    """Everything the checkpoint layer uses: who this rank is, the strategy, the store, the limits."""

    rank: int
    world_size: int
    device: torch.device  # where a collective's tensors live (the preemption flag)
    strategy: StateOwner
    optimizers: OptimizerStates
    group: Membership | None  # None with one process: nobody to wait for
    save_timeout: float
    say: Callable[[str], None]  # prints on global rank 0
    barrier: Callable[[], None]
    layout: Layout | None = None  # how the ranks divide (the manifest records it); None: not placed

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.group is not None


class Sync:
    """Keys in the c10d store for one save or load, polled with the save timeout (no collective)."""

    def __init__(self, ctx: CheckpointContext, what: str) -> None:
        self.group, self.timeout = ctx.group, ctx.save_timeout
        self.prefix = ctx.group.keys(what) if ctx.group is not None else ""

    def publish(self, key: str, value: str) -> None:
        if self.group is not None:
            self.group.store.set(f"{self.prefix}/{key}", value)

    def wait_one(self, rank: int, key: str, what: str) -> str:
        if self.group is None:
            raise RuntimeError("single process: nothing to wait for")  # not reached
        (raw,) = self.group.wait([f"{self.prefix}/{key}"], self.timeout, what, ranks=(rank,))
        value = raw.decode()
        if value.startswith("error: "):
            raise problem(
                f"the checkpoint failed on {value[7:]}",
                "See that rank's error above; the previous checkpoint is untouched",
            )
        return value
