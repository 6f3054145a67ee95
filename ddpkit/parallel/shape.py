"""The cluster's shape as a strategy sees it: one typed value, built once by the session from the
launcher's answer, handed to the strategy when it is built.

    shape = Shape(device, rank=3, world_size=8, local_rank=3, local_world_size=4)  # 2 nodes x 4
    shape.nodes, shape.local_world_size     # 2, 4
    shape.mesh                              # (("shard", 8),): the 1-D mesh FSDP shards over
    shape.with_mesh(replicate=2, shard=4)   # a 2-D description (HSDP: replicas across nodes)
    shape.device_mesh()                     # torch's DeviceMesh for that description

A strategy asks this value, not `torch.distributed`, for its ranks (rank, world, local ranks, nodes),
and builds its `DeviceMesh` from `mesh`, so a 2-D strategy is a different description of the same
ranks, not a different code path. It is also a `ddpkit.parallel.collectives.Ranks` (device,
distributed, world_size), so the collectives take it as they take a session.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from ddpkit.errors import problem

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

Mesh = tuple[tuple[str, int], ...]  # (dimension name, size), outermost first; sizes multiply to the world


@dataclass(frozen=True)
class Shape:
    """Where this rank stands among the others: device, rank, world, local ranks, nodes, mesh."""

    device: torch.device
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    mesh: Mesh = ()  # () -> (("shard", world_size),)

    def __post_init__(self) -> None:
        if not self.mesh:
            object.__setattr__(self, "mesh", (("shard", self.world_size),))
        sizes = [size for _, size in self.mesh]
        if math.prod(sizes) != self.world_size or min(sizes) < 1:
            raise problem(
                f"the mesh {dict(self.mesh)} does not cover the {self.world_size} ranks",
                "Give dimension sizes whose product is the world size",
            )

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def nodes(self) -> int:
        """Machines taking part (a launcher may start unequal numbers per node: rounded up)."""
        return -(-self.world_size // max(1, min(self.local_world_size, self.world_size)))

    def with_mesh(self, **dims: int) -> Shape:
        """The same ranks with another mesh description, e.g. `replicate=shape.nodes,
        shard=shape.local_world_size` (outermost first)."""
        return replace(self, mesh=tuple(dims.items()))

    def describe(self) -> str:
        where = f"{self.nodes} node(s) x {self.local_world_size}" if self.nodes > 1 else f"{self.world_size}"
        mesh = " x ".join(f"{name} {size}" for name, size in self.mesh)
        return f"{where} rank(s), mesh {mesh}" if len(self.mesh) > 1 else f"{where} rank(s)"

    def device_mesh(self) -> DeviceMesh:
        """torch's `DeviceMesh` for `mesh` (a collective: every rank calls it)."""
        from torch.distributed.device_mesh import init_device_mesh

        names = tuple(name for name, _ in self.mesh)
        return init_device_mesh(self.device.type, tuple(size for _, size in self.mesh), mesh_dim_names=names)
