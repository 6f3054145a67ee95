"""The cluster's shape as a strategy sees it: one typed value, built once by the session from the
launcher's answer, handed to the strategy when it is built.

    shape = Shape(device, rank=3, world_size=8, local_rank=3, local_world_size=4)  # 2 nodes x 4
    shape.nodes, shape.local_world_size     # 2, 4
    shape.mesh                              # (("shard", 8),): the 1-D mesh FSDP shards over (not placed yet)
    shape.with_layout(layout)               # placed: how the ranks divide (`ddpkit.parallel.layout`)
    shape.with_mesh(replicate=2, shard=4)   # the same, from mesh sizes (a plug-in's description)
    shape.device_mesh()                     # torch's DeviceMesh for that layout

Shape is where this rank stands (device, rank, world, local ranks, nodes); its `layout` is how the ranks
divide (`ddpkit.strategy.place` sets it once, from the strategy's dimensions and the user's degrees). A
strategy asks this value, not `torch.distributed`, for its ranks, and builds its `DeviceMesh` from the
layout, so a 2-D strategy is a different description of the same ranks, not a different code path. It is
also a `ddpkit.parallel.collectives.Ranks` (device, distributed, world_size), so the collectives take it
as they take a session.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from ddpkit.errors import problem
from ddpkit.parallel.layout import Layout, Mesh

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Mesh", "Shape"]


@dataclass(frozen=True)
class Shape:
    """Where this rank stands among the others: device, rank, world, local ranks, nodes, and (once
    placed) the layout of the ranks."""

    device: torch.device
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    layout: Layout | None = None  # None: the cluster only, not placed yet (`ddpkit.strategy.place` sets it)

    def __post_init__(self) -> None:
        if self.layout is not None and self.layout.world != self.world_size:
            raise problem(
                f"the mesh {dict(self.layout.mesh)} does not cover the {self.world_size} ranks",
                "Give dimension sizes whose product is the world size",
            )

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def nodes(self) -> int:
        """Machines taking part (a launcher may start unequal numbers per node: rounded up)."""
        return -(-self.world_size // max(1, min(self.local_world_size, self.world_size)))

    @property
    def mesh(self) -> Mesh:
        """The layout's mesh, outermost first; (("shard", world_size),) for a shape not placed yet."""
        return self._layout().mesh

    def with_layout(self, layout: Layout) -> Shape:
        """The same ranks, placed: divided as `layout` says."""
        return replace(self, layout=layout)

    def with_mesh(self, **dims: int) -> Shape:
        """The same ranks with a mesh given by sizes, e.g. `replicate=shape.nodes,
        shard=shape.local_world_size` (`Layout.from_mesh`)."""
        return self.with_layout(Layout.from_mesh(dims))

    def describe(self) -> str:
        where = f"{self.nodes} node(s) x {self.local_world_size}" if self.nodes > 1 else f"{self.world_size}"
        layout = self._layout()
        return f"{where} rank(s), mesh {layout.describe()}" if layout.meshed else f"{where} rank(s)"

    def device_mesh(self) -> DeviceMesh:
        """torch's `DeviceMesh` for the layout (a collective: every rank calls it)."""
        return self._layout().device_mesh(self.device.type)

    def _layout(self) -> Layout:
        return self.layout or Layout(shard=self.world_size, dims=("shard",))
