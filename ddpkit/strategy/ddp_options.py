"""`DDPOptions`: everything the DDP strategy is configured with (`ddpkit.strategy.ddp` builds the wrapper
from them; `ddpkit.strategy.single` gives each a defined meaning with one process).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from ddpkit.errors import problem

_CONSTRUCTOR = (
    "find_unused_parameters",
    "static_graph",
    "bucket_cap_mb",
    "gradient_as_bucket_view",
    "broadcast_buffers",
)


@dataclass(frozen=True, kw_only=True)
class DDPOptions:
    """Everything the DDP strategy is configured with; `ddpkit.session(strategy=DDPOptions(...))`.

    The DDP constructor options ddpkit passes through, with ddpkit's defaults, plus what ddpkit does
    around the wrapper: `sync_batchnorm` (statistics over the global batch), `comm_hook` (a gradient
    compression by name, `ddpkit.parallel.comm_hooks`) and `comm_hook_options` for it. `s.model(net,
    find_unused_parameters=True, ...)` is sugar for `s.model(net, strategy=DDPOptions(...))`.

    `gradient_as_bucket_view` defaults to True (unlike DDP): gradients live inside the all-reduce
    buckets instead of being copied in and out, which saves one gradient-sized copy of memory and a
    copy per step, with the same numbers.
    """

    find_unused_parameters: bool = False
    static_graph: bool = False
    bucket_cap_mb: float | None = None  # None: DDP's default (25 MB)
    gradient_as_bucket_view: bool = True
    broadcast_buffers: bool = True
    sync_batchnorm: bool = False
    comm_hook: str | None = None
    comm_hook_options: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.bucket_cap_mb is not None and self.bucket_cap_mb <= 0:
            raise problem(
                f"bucket_cap_mb={self.bucket_cap_mb} must be positive",
                "Pass a size in megabytes such as 25, or None for DDP's default",
            )

    def ddp_kwargs(self) -> dict:
        """The keyword arguments for torch's DistributedDataParallel (those that differ from its own)."""
        kwargs = {f.name: getattr(self, f.name) for f in fields(self) if f.name in _CONSTRUCTOR}
        if kwargs["bucket_cap_mb"] is None:
            del kwargs["bucket_cap_mb"]
        if kwargs["broadcast_buffers"]:  # DDP's default; torch 2.13 deprecates passing it explicitly
            del kwargs["broadcast_buffers"]
        return kwargs
