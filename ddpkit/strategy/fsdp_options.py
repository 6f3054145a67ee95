"""`FSDPOptions`: how FSDP2 shards a model, kept apart from `ddpkit.strategy.fsdp` so that a session
that never asks for FSDP does not import FSDP2's machinery (and safetensors) on its way to the first
step (ddpkit's imports are part of the time to the first step)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ddpkit.errors import problem


@dataclass(frozen=True, kw_only=True)
class FSDPOptions:
    """How FSDP2 shards the model; pass it as `s.model(net, strategy=FSDPOptions(...))`.

    `blocks`: module classes that become one FSDP unit each (e.g. your transformer block); None: by
    size, every module holding at least `min_block_params` parameters not yet in a unit.
    `reshard_after_forward`: free the gathered block after its forward (less memory, one more
    all-gather in backward). `cpu_offload`: keep the sharded parameters, gradients and optimizer step
    on the CPU (GPU ranks; on CPU ranks it changes nothing). `shm`: FSDP2's all-gather and
    reduce-scatter through shared memory (`ddpkit.parallel.fsdp_shm`); "auto" (and True) when the ranks are
    CPU ranks of one machine and the segment maps, else the process group's (gloo); False: always gloo.
    """

    blocks: tuple[type[nn.Module], ...] | None = None
    min_block_params: int = 1_000_000
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    shm: bool | str = "auto"

    def __post_init__(self) -> None:
        if self.shm not in (True, False, "auto"):
            raise problem(
                f"shm={self.shm!r} is not True, False or 'auto'",
                "Pass shm='auto' (shared memory on one machine) or False",
            )
        if self.min_block_params < 1:
            raise problem(
                f"min_block_params={self.min_block_params} is below 1",
                "Pass a parameter count such as 1_000_000",
            )
        if self.blocks is not None and not all(
            isinstance(b, type) and issubclass(b, nn.Module) for b in self.blocks
        ):
            raise problem(
                f"blocks={self.blocks!r} holds something that is not an nn.Module class",
                "Pass module classes, e.g. blocks=(TransformerBlock,)",
            )
