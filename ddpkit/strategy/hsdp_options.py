"""`HSDPOptions`: the degrees of HSDP's 2-D mesh and FSDP's options, kept apart from
`ddpkit.strategy.hsdp` (as `fsdp_options` is from `fsdp`) so that naming the options in the registry
does not import FSDP2's machinery into a session that never asks for it."""

from __future__ import annotations

from dataclasses import dataclass

from ddpkit.errors import problem
from ddpkit.parallel.shape import Shape
from ddpkit.strategy.fsdp_options import FSDPOptions


@dataclass(frozen=True, kw_only=True)
class HSDPOptions(FSDPOptions):
    """FSDP's options (`FSDPOptions`) plus the two degrees of the hybrid mesh.

    `shard`: ranks that shard one replica (None: the local world size, i.e. one node). `replicate`:
    replicas (None: world / shard, i.e. the nodes). `within_node`: refuse a shard group that would
    span nodes (its all-gathers and reduce-scatters would cross the slow link, which HSDP avoids).
    """

    replicate: int | None = None
    shard: int | None = None
    within_node: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, value in (("replicate", self.replicate), ("shard", self.shard)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise problem(
                    f"HSDPOptions({name}={value!r}) is not a positive whole number",
                    f"Pass {name}=1 or more, or leave it None (from the launcher)",
                )

    def degrees(self, shape: Shape) -> tuple[int, int]:
        """(replicate, shard) for these ranks, or a clear error naming the fix."""
        world, local = shape.world_size, max(1, min(shape.local_world_size, shape.world_size))
        shard = self.shard or (world // self.replicate if self.replicate else local)
        replicate = self.replicate or max(1, world // shard)
        if replicate * shard != world:
            raise problem(
                f"HSDP's degrees replicate={replicate} x shard={shard} = {replicate * shard} do not cover "
                f"the {world} ranks of this job",
                f"Give degrees whose product is {world} (e.g. HSDPOptions(replicate="
                f"{max(1, world // local)}, shard={local}): shard inside each node, replicate across nodes), "
                "or leave both None",
            )
        if self.within_node and local % shard:
            raise problem(
                f"HSDP's shard groups of {shard} ranks would span nodes of {local} ranks: their "
                "all-gathers and reduce-scatters would cross the slow link every step",
                f"Pass a shard degree that divides {local} (e.g. shard={local}), or "
                "HSDPOptions(within_node=False) to shard across nodes on purpose",
            )
        return replicate, shard
