"""`HSDPOptions`: the degrees of HSDP's 2-D mesh and FSDP's options, kept apart from
`ddpkit.strategy.hsdp` (as `fsdp_options` is from `fsdp`) so that naming the options in the registry
does not import FSDP2's machinery into a session that never asks for it."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ddpkit.errors import problem
from ddpkit.strategy.fsdp_options import FSDPOptions


@dataclass(frozen=True, kw_only=True)
class HSDPOptions:
    """The two degrees of the hybrid mesh, and FSDP's options (`FSDPOptions`'s fields and defaults).

    `shard`: ranks that shard one replica (None: the local world size, i.e. one node). `replicate`:
    replicas (None: world / shard, i.e. the nodes). `within_node`: refuse a shard group that would
    span nodes (its all-gathers and reduce-scatters would cross the slow link, which HSDP avoids).
    `shm`: True takes each shard group's all-gathers and reduce-scatters through shared memory on CPU
    ranks (the replicas' all-reduce stays on the process group); "auto" (the default) and False keep the
    process group for all of them (`ddpkit.strategy.hsdp`).
    The degrees become the session's layout (`ddpkit.parallel.layout.build`); `fsdp()` is the FSDP part.
    """

    replicate: int | None = None
    shard: int | None = None
    within_node: bool = True
    blocks: tuple[type[nn.Module], ...] | None = None
    min_block_params: int = 1_000_000
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    shm: bool | str = "auto"

    def __post_init__(self) -> None:
        self.fsdp()  # FSDP's fields, validated by FSDPOptions (the one validation)
        for name, value in (("replicate", self.replicate), ("shard", self.shard)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise problem(
                    f"HSDPOptions({name}={value!r}) is not a positive whole number",
                    f"Pass {name}=1 or more, or leave it None (from the launcher)",
                )

    def fsdp(self) -> FSDPOptions:
        """The FSDP part: how each shard group shards the model."""
        return FSDPOptions(
            blocks=self.blocks,
            min_block_params=self.min_block_params,
            reshard_after_forward=self.reshard_after_forward,
            cpu_offload=self.cpu_offload,
            shm=self.shm,
        )
