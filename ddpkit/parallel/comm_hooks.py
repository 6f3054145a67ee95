"""DDP communication hooks by name: `s.model(net, comm_hook="fp16")`.

A hook replaces DDP's all-reduce of each gradient bucket. What each name trades for fewer bytes:

| name       | bytes sent        | accuracy of the averaged gradient                                |
|------------|-------------------|------------------------------------------------------------------|
| (none)     | fp32: 4 per value | exact up to fp32 rounding of the sum                             |
| "fp16"     | 2 per value       | 11-bit mantissa (relative error <= 4.9e-4 per value); |g|/world  |
|            |                   | below ~6e-8 flushes to zero, above 65504 overflows to inf (the   |
|            |                   | gradient is divided by the world size before the all-reduce)     |
| "bf16"     | 2 per value       | 8-bit mantissa (relative error <= 3.9e-3 per value) with fp32's  |
|            |                   | range: no overflow or underflow; coarser than fp16 when in range |
| "powersgd" | ~r(n+m) per n x m | rank-r approximation of each matrix gradient (biases exact);     |
|            | matrix            | biased per step, with error feedback carrying the residual into  |
|            |                   | the next steps, so training converges; plain all-reduce for the  |
|            |                   | first `start_powerSGD_iter` steps (ddpkit's default 10); a QR    |
|            |                   | per matrix on every step                                         |
| "shm"      | shared memory     | exact; ranks on one machine only (ddpkit/parallel/shm_allreduce.py)       |

Measured (tests/test_comm_hooks.py, a 6.5k-parameter MLP at world 2, after 6 steps), as the relative
norm of (hooked - exact) averaged gradient: fp16 3.2e-4, bf16 2.4e-3, PowerSGD rank 1 1.3: a single
PowerSGD step is far from the exact average (it also carries the residual of earlier steps), yet the
loss falls, because the error feedback delivers what a step left out in the steps that follow. Prefer
fp16 for well-scaled gradients, bf16 when fp16 would overflow, PowerSGD only when bandwidth dominates
(large matrices, slow links) and after checking convergence. On one process there is nothing to
communicate: the hook is ignored (logged once).

The registry maps a name to "module:function"; the module is imported only when the name is asked for.
A factory has the signature `factory(process_group, **options) -> (state, hook)` and `hook(state,
bucket) -> torch.futures.Future[torch.Tensor]`, DDP's contract (`register_comm_hook`).
"""

import importlib  # no `from __future__ import annotations`: DDP compares hook annotations to real types
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from ddpkit.errors import problem

Factory = Callable[..., tuple[Any, Callable[..., Any]]]

HOOKS: dict[str, str] = {
    "fp16": "ddpkit.parallel.comm_hooks:fp16",
    "bf16": "ddpkit.parallel.comm_hooks:bf16",
    "powersgd": "ddpkit.parallel.comm_hooks:powersgd",
    "shm": "ddpkit.parallel.shm_hook:shm_hook_factory",  # same-node shared memory; imported when asked
}


def fp16(process_group: dist.ProcessGroup | None) -> tuple[Any, Callable[..., Any]]:
    """torch's `fp16_compress_hook`: cast to float16, divide by the world size, all-reduce, cast back."""
    return process_group, default_hooks.fp16_compress_hook


def bf16_compress(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's `bf16_compress_hook` under another name (see `bf16`)."""
    return default_hooks.bf16_compress_hook(state, bucket)


def bf16(process_group: dist.ProcessGroup | None) -> tuple[Any, Callable[..., Any]]:
    """torch's `bf16_compress_hook`. DDP refuses that hook by its name unless NCCL >= 2.10 is present,
    although gloo all-reduces bfloat16 fine; on a non-NCCL group ddpkit registers the same function
    behind a one-line wrapper with another name."""
    nccl = dist.get_backend(process_group) == "nccl"
    return process_group, default_hooks.bf16_compress_hook if nccl else bf16_compress


def powersgd(
    process_group: dist.ProcessGroup | None,
    *,
    matrix_approximation_rank: int = 1,
    start_powerSGD_iter: int = 10,
    **options: Any,
) -> tuple[Any, Callable[..., Any]]:
    """torch's PowerSGD (`powerSGD_hook`) with error feedback and warm start; options go to PowerSGDState."""
    state = powerSGD_hook.PowerSGDState(
        process_group=process_group,
        matrix_approximation_rank=matrix_approximation_rank,
        start_powerSGD_iter=start_powerSGD_iter,
        **options,
    )
    return state, powerSGD_hook.powerSGD_hook


def resolve(name: str) -> Factory:
    """The factory registered under `name`, importing its module now."""
    target = HOOKS.get(name)
    if target is None:
        raise problem(
            f"comm_hook={name!r} is not a known communication hook",
            f"Use one of {sorted(HOOKS)}, or None for DDP's plain fp32 all-reduce",
        )
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        raise problem(
            f"comm_hook={name!r} lives in {module_name}, which is not installed in this ddpkit",
            "Use another hook (fp16, bf16, powersgd) or None",
        ) from None
    return getattr(module, attr)


def register(
    model: DistributedDataParallel,
    name: str,
    options: Mapping[str, Any] | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> Any:
    """Register hook `name` on a DDP model (before its first backward); return the hook's state."""
    if not isinstance(model, DistributedDataParallel):
        raise problem(
            f"comm_hook={name!r} needs a DistributedDataParallel model, got {type(model).__name__}",
            "Pass comm_hook= to s.model(...), which wraps the model first",
        )
    factory = resolve(name)
    try:
        state, hook = factory(process_group, **dict(options or {}))
    except TypeError as exc:
        if not options:
            raise
        raise problem(
            f"comm_hook={name!r} does not accept the options {sorted(options)} ({exc})",
            "Drop comm_hook_options, or pass only the options that hook's factory takes",
        ) from None
    model.register_comm_hook(state, hook)
    return state
