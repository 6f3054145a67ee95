"""SyncBatchNorm that also runs on CPU (gloo): batch statistics over the global batch.

torch's `nn.SyncBatchNorm` is CUDA-only, and DDP refuses it on CPU ("SyncBatchNorm layers only work with
GPU modules"), so ddpkit uses this module on CPU and torch's on CUDA (`wrap.py` decides). It is a plain
`_BatchNorm` (not a subclass of `nn.SyncBatchNorm`), which is why DDP accepts it.

The statistics are exact two-pass ones, numerically stable for data far from zero:
  1. all-reduce [sum of x per channel, element count]  -> global mean
  2. all-reduce sum of (x - mean)^2 per channel        -> global (biased) variance
Both all-reduces are differentiable (`_AllReduceSum`: the backward of a sum over ranks is the sum over
ranks of the incoming gradients), so autograd yields the exact gradient of the global-batch
normalisation: the same gradient as one process normalising the concatenated batch. Cost: two small
all-reduces per layer in forward and two in backward (torch's CUDA kernel: one all-gather + one
all-reduce). Running statistics follow `BatchNorm`: momentum (or cumulative average when momentum is
None) and the unbiased variance over the GLOBAL batch, so they are identical on every rank. A rank may
bring an empty batch; every rank must call forward equally often (it is a collective), which is why
`s.join` (uneven inputs) cannot shadow it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ddpkit.errors import problem


class _AllReduceSum(torch.autograd.Function):
    """Sum over the ranks of `group`, differentiable: every rank's output feeds every rank's loss, so the
    gradient reaching each input is the sum of all ranks' output gradients."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = tensor.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=ctx.group)
        return out, None


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over N-d input (N, C, ...) whose training statistics span every rank of `process_group`."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise problem(
                f"SyncBatchNorm expects input of shape (N, C, ...), got {tuple(input.shape)}",
                "Pass a batch with a channel dimension",
            )

    def _needs_sync(self) -> bool:
        if not (self.training and dist.is_available() and dist.is_initialized()):
            return False
        return dist.get_world_size(self.process_group) > 1

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self._needs_sync():
            return super().forward(input)
        return self._sync_forward(input)

    def _sync_forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self.process_group or dist.group.WORLD
        dims = [0, *range(2, x.dim())]
        shape = [1, -1] + [1] * (x.dim() - 2)
        work = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x  # statistics in fp32 at least
        count_local = work.new_tensor([x.numel() / max(1, x.size(1))])
        first = _AllReduceSum.apply(torch.cat([work.sum(dims), count_local]), group)
        count = first[-1].detach()
        if count.item() <= 1:
            raise problem(
                f"SyncBatchNorm got {int(count.item())} value(s) per channel over all ranks in training",
                "Use a global batch of at least 2 samples, or call model.eval() for single samples",
            )
        mean = first[:-1] / count
        centred = work - mean.view(shape)
        var = _AllReduceSum.apply((centred * centred).sum(dims), group) / count
        y = centred * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        if self.track_running_stats:
            self._update_running_stats(mean.detach(), var.detach(), count)
        return y.to(x.dtype)

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, count: torch.Tensor) -> None:
        assert self.num_batches_tracked is not None and self.running_mean is not None
        assert self.running_var is not None
        self.num_batches_tracked.add_(1)
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        unbiased = var * (count / (count - 1))
        self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
        self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)


def convert_sync_batchnorm(module: nn.Module, process_group: dist.ProcessGroup | None = None) -> nn.Module:
    """Replace every BatchNorm*d in `module` by ddpkit's `SyncBatchNorm`, sharing parameters and buffers.

    Mirrors `nn.SyncBatchNorm.convert_sync_batchnorm`; returns the converted module (the root itself
    is replaced when it is a BatchNorm).
    """
    out = module
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        out = SyncBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            process_group,
        )
        if module.affine:
            with torch.no_grad():
                out.weight = module.weight
                out.bias = module.bias
        out.running_mean = module.running_mean
        out.running_var = module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.training = module.training
        if hasattr(module, "qconfig"):
            out.qconfig = module.qconfig
    for name, child in module.named_children():
        out.add_module(name, convert_sync_batchnorm(child, process_group))
    return out


def has_batchnorm(module: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())


def convert_batchnorm(module: nn.Module, device_type: str) -> nn.Module:
    """BatchNorm layers to synchronised ones: torch's CUDA kernel on CUDA, ddpkit's elsewhere."""
    if device_type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(module)
    return convert_sync_batchnorm(module)
