"""The noise floor: how far one process moves from itself when only its summation order changes.

Floating-point addition is not associative, so a gradient summed over 32 samples in one process and
one summed as two halves of 16 (DDP on 2 ranks, then an all-reduce) differ in the last bits; training
then carries and sometimes magnifies the difference (Adam divides by the square root of tiny second
moments). Whether DDP is "the same" can therefore only be judged against the same kind of noise
measured on the same model: the reference run repeated with its batch rows permuted, or with another
thread count. The floor of a tensor at step t is the largest deviation any such variant showed up to
step t (deviations accumulate; a variant that happens to dip at one step says nothing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ddpkit.verify.spec import Tolerance


@dataclass(frozen=True)
class Deviation:
    """How far tensor `b` is from the reference `a`."""

    rel_norm: float  # ||b - a|| / ||a||
    max_abs: float  # max |b - a|
    max_rel: float  # max |b - a| / |a| over the elements (|a| at least eps * max|a|)
    norm: float  # ||b - a||


def deviation(a: torch.Tensor, b: torch.Tensor) -> Deviation:
    """Deviation of `b` from `a`, computed in float64 (exact for integer tensors)."""
    a64, b64 = a.detach().double(), b.detach().double()
    d = (b64 - a64).abs()
    if d.numel() == 0:
        return Deviation(0.0, 0.0, 0.0, 0.0)
    norm = float(d.norm())
    ref = float(a64.norm())
    # Elements below one ulp of the tensor's largest count as that: an exact zero in the reference (a
    # gradient that vanished) would otherwise make any rounding an "infinite" relative difference.
    eps = torch.finfo(a.dtype).eps if a.is_floating_point() else 1.0
    tiny = max(eps * float(a64.abs().max()), torch.finfo(torch.float64).tiny)
    return Deviation(
        rel_norm=norm / ref if ref > 0 else (0.0 if norm == 0 else float("inf")),
        max_abs=float(d.max()),
        max_rel=float((d / a64.abs().clamp_min(tiny)).max()),
        norm=norm,
    )


@dataclass(frozen=True)
class Limit:
    """The tolerance of one tensor at one step."""

    rel_norm: float
    max_abs: float
    floor_rel_norm: float
    floor_max_abs: float

    def excess(self, dev: Deviation) -> float:
        """How many times the tolerance `dev` uses: <= 1 passes (0/0 counts as 0, x/0 as inf)."""
        return max(_ratio(dev.rel_norm, self.rel_norm), _ratio(dev.max_abs, self.max_abs))


def _ratio(x: float, limit: float) -> float:
    if x == 0:
        return 0.0
    return x / limit if limit > 0 else float("inf")


def floors(
    reference: list[dict[str, torch.Tensor]], variants: list[list[dict[str, torch.Tensor]]]
) -> list[dict[str, tuple[float, float]]]:
    """Per step and tensor: (rel norm, max abs) floor, the running maximum over variants and steps."""
    out: list[dict[str, tuple[float, float]]] = []
    running: dict[str, tuple[float, float]] = {}
    for step, ref in enumerate(reference):
        for name, a in ref.items():
            rel, mx = running.get(name, (0.0, 0.0))
            for states in variants:
                if step < len(states) and name in states[step]:
                    dev = deviation(a, states[step][name])
                    rel, mx = max(rel, dev.rel_norm), max(mx, dev.max_abs)
            running[name] = (rel, mx)
        out.append(dict(running))
    return out


def limit(tol: Tolerance, a: torch.Tensor, floor: tuple[float, float], update: Deviation | None) -> Limit:
    """The tolerance for tensor `a` (the reference value) given its floor and the step's update to it.

    Exact for integer tensors. `update` is the deviation of `a` from its value one step earlier (None
    before the first step); see `Tolerance` for the formula.
    """
    if not a.is_floating_point():
        return Limit(0.0, 0.0, 0.0, 0.0)
    eps_rel = tol.min_rel(a.dtype)
    scale = float(a.detach().abs().max()) if a.numel() else 0.0
    size = float(a.detach().double().norm())
    moved_rel = update.norm / size if update and size > 0 else 0.0
    moved_abs = update.max_abs if update else 0.0
    return Limit(
        rel_norm=max(tol.floor_multiple * floor[0], eps_rel, tol.update_fraction * moved_rel),
        max_abs=max(tol.floor_multiple * floor[1], eps_rel * scale, tol.update_fraction * moved_abs),
        floor_rel_norm=floor[0],
        floor_max_abs=floor[1],
    )


def floor_summary(floor_by_step: list[dict[str, tuple[float, float]]]) -> dict[str, float]:
    """The largest floor over all tensors at the last step, for the report's headline."""
    last = floor_by_step[-1] if floor_by_step else {}
    return {
        "max_rel_norm": max((v[0] for v in last.values()), default=0.0),
        "max_abs": max((v[1] for v in last.values()), default=0.0),
    }


class FeatureSplit(torch.overrides.TorchFunctionMode):
    """The "features" floor variant: every `F.linear`'s sum over its input features done in 3 pieces,
    then added in order. Tensor parallelism splits exactly those sums (a row-wise layer's halves, then an
    all-reduce); permuting rows or chunking the batch never reorders them, so under TP only this variant
    measures the noise TP itself adds."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.linear:
            return func(*args, **kwargs)
        x, w = args[0], args[1]
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        parts = [F.linear(xc, wc) for xc, wc in zip(x.chunk(3, -1), w.chunk(3, -1), strict=True)]
        y = parts[0]
        for part in parts[1:]:
            y = y + part
        return y + bias if bias is not None else y
