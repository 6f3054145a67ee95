"""Strategies: what data parallelism means for a model ("single", "ddp", "fsdp"); see `base.Strategy`.

`make` turns the name a user passed (to `ddpkit.session(strategy=)` or `s.model(strategy=)`) into the
strategy object the session, the stepper and checkpoints ask. "auto" is "ddp" with more than one
process; any name is "single" with one process (said once).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ddpkit.collectives import Ranks
from ddpkit.errors import problem
from ddpkit.strategy.base import Strategy
from ddpkit.strategy.ddp import DDP
from ddpkit.strategy.fsdp import FSDP, FSDPOptions
from ddpkit.strategy.single import Single
from ddpkit.wrap import DDPOptions

NAMES = ("auto", "single", "ddp", "fsdp")

__all__ = ["DDP", "FSDP", "NAMES", "FSDPOptions", "Single", "Strategy", "check_name", "make"]


def check_name(strategy: Any) -> str:
    """The strategy's name, or a clear error for anything else."""
    if isinstance(strategy, FSDPOptions):
        return "fsdp"
    if strategy not in NAMES:
        raise problem(f"strategy={strategy!r} is not one of {', '.join(map(repr, NAMES))}",
                      "Pass 'ddp' (replicas), 'fsdp' (sharded parameters) or 'auto'")  # fmt: skip
    return strategy


def make(
    strategy: str | FSDPOptions,
    ranks: Ranks,
    *,
    precision: str = "32",
    ddp: DDPOptions | None = None,
    sync_batchnorm: bool = False,
    comm_hook: str | None = None,
    comm_hook_options: Mapping[str, Any] | None = None,
) -> Strategy:
    """The strategy object for `strategy` on these ranks, with the options that apply to it."""
    name = check_name(strategy)
    ddp = ddp or DDPOptions()
    if not ranks.distributed:
        asked = name if name in ("ddp", "fsdp") else None
        return Single(ddp, sync_batchnorm=sync_batchnorm, comm_hook=comm_hook, asked=asked)
    if name == "fsdp":
        changed = ddp != DDPOptions() or sync_batchnorm or comm_hook is not None
        if changed:
            raise problem(
                "DDP options (find_unused_parameters, static_graph, bucket_cap_mb, gradient_as_bucket_view, "
                "broadcast_buffers, sync_batchnorm, comm_hook) were passed with strategy='fsdp'",
                "Leave them out with FSDP, or pass strategy='ddp'",
            )
        return FSDP(strategy if isinstance(strategy, FSDPOptions) else None, ranks, precision)
    if name == "single":
        raise problem(
            f"strategy='single' with {ranks.world_size} processes would train unsynchronised replicas",
            "Pass strategy='ddp' or 'fsdp', or start one process",
        )
    return DDP(ddp, sync_batchnorm=sync_batchnorm, comm_hook=comm_hook, comm_hook_options=comm_hook_options)
