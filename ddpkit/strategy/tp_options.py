"""`TPOptions`: the tensor degree, the plan and how the data dimensions parallelise, kept apart from
`ddpkit.strategy.tp` (as `fsdp_options` is from `fsdp`) so that naming the options in the registry does
not import torch's tensor-parallel machinery into a session that never asks for it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from ddpkit.errors import problem
from ddpkit.strategy.fsdp_options import FSDPOptions

RANDOM_POLICIES = ("one-process", "per-shard")


@dataclass(frozen=True, kw_only=True)
class TPOptions:
    """Tensor parallelism (layers split over `tensor` ranks) with FSDP2 over the other ranks.

    `tensor`: ranks that split each layer (None: the ranks of one node; a group spanning nodes is
    refused unless `tensor_across_nodes`). `replicate`, `shard`: the data-parallel degrees over the rest,
    as HSDP's (None: shard = the data ranks of a node, replicate = the nodes; `shard=1` is replicated
    data parallelism, DDP's arithmetic through FSDP2's replicate mesh: torch's DDP cannot hold
    tensor-parallel parameters). `plan`: "auto" (a Hugging Face model's own `base_model_tp_plan`), a
    short mapping {"blocks.*.attn.q": "colwise", ...}, or torch `ParallelStyle`s as values.
    `sequence_parallel`: norms (and the dropout between blocks) split along the sequence, the residual
    stream kept as DTensors (ddpkit derives the styles from the plan). `loss_parallel`: the head's
    output left sharded over the vocabulary. `random`: "one-process" (dropout under TP draws one
    process's masks; a draw ddpkit cannot give that way is refused) or "per-shard" (torch's draws:
    equal to one process in distribution only). The other fields are FSDP's (`fsdp()`).
    """

    tensor: int | None = None
    replicate: int | None = None
    shard: int | None = None
    tensor_across_nodes: bool = False
    plan: str | Mapping[str, Any] = "auto"
    sequence_parallel: bool = False
    loss_parallel: bool = False
    random: str = "one-process"
    blocks: tuple[type[nn.Module], ...] | None = None
    min_block_params: int = 1_000_000
    reshard_after_forward: bool = True
    cpu_offload: bool = False

    def __post_init__(self) -> None:
        self.fsdp()  # FSDP's fields, validated by FSDPOptions (the one validation)
        for name in ("tensor", "replicate", "shard"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise problem(
                    f"TPOptions({name}={value!r}) is not a positive whole number",
                    f"Pass {name}=1 or more, or leave it None (from the launcher)",
                )
        if self.random not in RANDOM_POLICIES:
            raise problem(
                f"TPOptions(random={self.random!r}) is not one of {', '.join(map(repr, RANDOM_POLICIES))}",
                "Pass random='one-process' (dropout as one process draws it) or 'per-shard'",
            )
        if not (self.plan == "auto" or isinstance(self.plan, Mapping)):
            raise problem(
                f"TPOptions(plan={self.plan!r}) is neither 'auto' nor a mapping of module names to styles",
                "Pass plan='auto' (a Hugging Face model's own plan) or e.g. plan={'blocks.*.attn.q': "
                "'colwise', 'blocks.*.attn.o': 'rowwise'}",
            )

    def fsdp(self) -> FSDPOptions:
        """The FSDP part: how the data dimensions shard the model (over the process group: the
        shared-memory collectives serve a 1-D mesh only)."""
        return FSDPOptions(
            blocks=self.blocks,
            min_block_params=self.min_block_params,
            reshard_after_forward=self.reshard_after_forward,
            cpu_offload=self.cpu_offload,
            shm=False,
        )
