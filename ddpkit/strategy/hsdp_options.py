"""`HSDPOptions`: the degrees of HSDP's 2-D mesh and FSDP's options, kept apart from
`ddpkit.strategy.hsdp` (as `fsdp_options` is from `fsdp`) so that naming the options in the registry
does not import FSDP2's machinery into a session that never asks for it."""

from __future__ import annotations

import math
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
        """(replicate, shard) for these ranks, or a clear error naming the degrees given and the fix."""
        world, local = shape.world_size, max(1, min(shape.local_world_size, shape.world_size))
        replicate, shard = self._cover(world, local)
        if self.within_node and local % shard:
            raise problem(
                f"{self._given()} make shard groups of {shard} ranks, which would span nodes of {local} "
                "ranks: their all-gathers and reduce-scatters would cross the slow link every step",
                f"Pass a shard degree that divides {local} (e.g. shard={math.gcd(world, local)}), or "
                "HSDPOptions(within_node=False) to shard across nodes on purpose",
            )
        return replicate, shard

    def _given(self) -> str:
        """The degrees as the user wrote them: "the degrees of HSDPOptions(replicate=2)" (a None is
        left out: the user did not write it)."""
        given = [f"{n}={v}" for n, v in (("replicate", self.replicate), ("shard", self.shard)) if v]
        return f"the degrees of HSDPOptions({', '.join(given)})" if given else "HSDP's default degrees"

    def _cover(self, world: int, local: int) -> tuple[int, int]:
        """(replicate, shard) whose product is `world`: the degree not given follows from the one given
        (both None: shard = a node's ranks); a degree that does not divide the world is refused."""
        if self.replicate and self.shard:
            if self.replicate * self.shard == world:
                return self.replicate, self.shard
            what = f"replicate {self.replicate} x shard {self.shard} = {self.replicate * self.shard} ranks"
        elif self.replicate or self.shard:
            given = self.replicate or self.shard or 1
            if world % given == 0:
                return (given, world // given) if self.replicate else (world // given, given)
            other = "shard" if self.replicate else "replicate"
            what = f"{other} would be {world}/{given} ranks (not a whole number)"
        else:
            if world % local == 0:
                return world // local, local
            what = f"nodes of unequal size (shard = the {local} ranks of this node)"
        example = math.gcd(world, local)  # divides the world and a node: a shape that is always accepted
        rest = ", or leave both None" if self.replicate or self.shard else ""
        raise problem(
            f"{self._given()} do not cover the {world} ranks of this job: {what}",
            f"Give degrees whose product is {world} (e.g. HSDPOptions(replicate={world // example}, "
            f"shard={example}): shard inside each node, replicate across nodes){rest}",
        )
