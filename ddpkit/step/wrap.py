"""Model preparation: to the device, SyncBatchNorm on request, DDP only when there are peers.

SyncBatchNorm: torch's `nn.SyncBatchNorm` on CUDA; on CPU, where DDP refuses torch's, ddpkit's own
(`ddpkit.step.syncbn`), with the same statistics over the global batch. Communication hooks are registered by
name right after wrapping (`ddpkit.step.comm_hooks`).

DataParallel is not a mode: one process driving several GPUs with threads copies the model to every
GPU on every step and serialises on the Python interpreter; DDP (one process per GPU) replaced it.
Benchmarks may show it for comparison; nothing in ddpkit uses it.

DDP broadcasts global rank 0's parameters and buffers once, when it is constructed, and from then on
averages gradients bucket by bucket during backward. In the single-process modes there is nothing to
synchronise, so every DDP option gets a defined meaning there (logged once): it is accepted and has no
effect, because a single replica already computes the full-batch gradient.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddpkit.errors import problem

_CONSTRUCTOR = ("find_unused_parameters", "static_graph", "bucket_cap_mb", "gradient_as_bucket_view",
                "broadcast_buffers")  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class DDPOptions:
    """Everything the DDP strategy is configured with; `ddpkit.session(strategy=DDPOptions(...))`.

    The DDP constructor options ddpkit passes through, with ddpkit's defaults, plus what ddpkit does
    around the wrapper: `sync_batchnorm` (statistics over the global batch), `comm_hook` (a gradient
    compression by name, `ddpkit.step.comm_hooks`) and `comm_hook_options` for it. `s.model(net,
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


def has_batchnorm(module: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())


def convert_batchnorm(module: nn.Module, device_type: str) -> nn.Module:
    """BatchNorm layers to synchronised ones: torch's CUDA kernel on CUDA, ddpkit's elsewhere."""
    if device_type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(module)
    from ddpkit.step.syncbn import convert_sync_batchnorm

    return convert_sync_batchnorm(module)


def wrap_model(
    module: nn.Module,
    *,
    device: torch.device,
    distributed: bool,
    options: DDPOptions,
) -> tuple[nn.Module, list[str]]:
    """Prepare `module` for training; return the model to train and notes worth logging once."""
    sync_batchnorm, comm_hook = options.sync_batchnorm, options.comm_hook
    if isinstance(module, DistributedDataParallel):
        raise problem(
            "the model is already wrapped in DistributedDataParallel",
            "Pass the plain nn.Module; ddpkit wraps it when the world size is above 1",
        )
    notes: list[str] = []
    module = module.to(device)
    if not distributed:
        if sync_batchnorm and has_batchnorm(module):
            notes.append("sync_batchnorm: one process, BatchNorm already sees the whole batch; kept as is")
        changed = {k: v for k, v in options.ddp_kwargs().items() if v != _DEFAULTS.get(k, True)}
        if changed:
            notes.append(f"DDP options {changed} have no effect with one process (no gradients to average)")
        if comm_hook is not None:
            notes.append(f"comm_hook={comm_hook!r} has no effect with one process (nothing to communicate)")
        return module, notes
    if sync_batchnorm:
        module = convert_batchnorm(module, device.type)
    elif has_batchnorm(module):
        notes.append(
            "BatchNorm computes statistics per rank (per-rank batch); pass sync_batchnorm=True for "
            "statistics over the global batch"
        )
    device_ids = [device.index] if device.type == "cuda" else None
    ddp = DistributedDataParallel(module, device_ids=device_ids, **options.ddp_kwargs())
    if comm_hook is not None:
        from ddpkit.step import comm_hooks

        state = comm_hooks.register(ddp, comm_hook, options.comm_hook_options)
        if getattr(state, "active", True) is False:  # e.g. "shm" across machines: say why, once
            notes.append(f"comm_hook={comm_hook!r}: {state.reason}")
    return ddp, notes


_DEFAULTS = DDPOptions().ddp_kwargs()


def ddp_of(model: nn.Module) -> DistributedDataParallel | None:
    """The DDP wrapper of `model` (also under any number of torch.compile wrappers), or None."""
    while not isinstance(model, DistributedDataParallel):
        inner = getattr(model, "_orig_mod", None)  # torch.compile's OptimizedModule
        if not isinstance(inner, nn.Module):
            return None
        model = inner
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside any nesting of DDP and torch.compile wrappers: keys without `module.`.

    Both orders users write are covered: `DDP(torch.compile(net))` (compile inside, torch's guidance
    and `s.model(net, compile=True)`) and `torch.compile(DDP(net))` (compile outside).
    """
    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch.compile's OptimizedModule
            model = model._orig_mod  # type: ignore[assignment]  # checked to be a module just above
        else:
            return model
