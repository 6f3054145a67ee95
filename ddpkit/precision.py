"""Mixed precision: which autocast dtype, and whether a gradient scaler, for a device and a request.

| `precision=` | CUDA                                          | CPU                                  |
|--------------|-----------------------------------------------|--------------------------------------|
| "32"         | fp32 everywhere                               | fp32 everywhere                      |
| "bf16"       | autocast bfloat16 (fp16 + scaler if the GPU   | autocast bfloat16                    |
|              | has no bf16: pre-Ampere, said at start)       |                                      |
| "16"         | autocast float16 + gradient scaler            | autocast bfloat16 (said at start)    |

"Mixed": weights, gradients and optimizer state stay fp32; autocast runs only the ops that gain from 16
bits (matmul, convolution) in 16 bits. Why a scaler only for fp16: fp16 has 5 exponent bits, so small
gradients underflow to zero unless the loss is multiplied by a large factor before backward (and the
gradients divided by it before the step); a step whose gradients overflowed to inf/nan is skipped and
the factor lowered. bf16 keeps fp32's 8 exponent bits, so it needs no scaler. fp16 without CUDA falls
back to bf16: the same 16-bit storage, with fp32's range and no scaler.

Everything here is pure except `make_scaler`; `resolve_precision` is table-tested.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddpkit.errors import problem

_ALIASES = {
    "32": "32", "fp32": "32", "32-true": "32",
    "bf16": "bf16", "bf16-mixed": "bf16",
    "16": "16", "fp16": "16", "16-mixed": "16",
}  # fmt: skip
_DTYPES = {"32": None, "bf16": torch.bfloat16, "16": torch.float16}


@dataclass(frozen=True)
class PrecisionPlan:
    """What runs: `name` ("32", "bf16", "16") on `device_type`; `note` says why it differs from the request.

    `resolve_precision` builds it. Constructing one directly forces a combination, e.g.
    `PrecisionPlan("16", "cpu")` runs fp16 autocast with a CPU gradient scaler (tests use it).
    """

    name: str
    device_type: str
    requested: str = ""
    note: str | None = None

    def __post_init__(self) -> None:
        if self.name not in _DTYPES:
            raise problem(f"precision {self.name!r} is not one of '32', 'bf16', '16'", "Use one of those")

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The dtype autocast runs matmuls and convolutions in; None: no autocast."""
        return _DTYPES[self.name]

    @property
    def scaler(self) -> bool:
        """True when gradients need a loss scale (fp16 only)."""
        return self.name == "16"

    def describe(self) -> str:
        if self.name == "32":
            return "precision 32: fp32 everywhere"
        dtype = str(self.autocast_dtype).removeprefix("torch.")
        scaler = ", gradient scaler" if self.scaler else ""
        return f"precision {self.name}: autocast {dtype} on {self.device_type}, fp32 weights{scaler}"


def resolve_precision(
    requested: str | PrecisionPlan, device_type: str, *, bf16_supported: bool = True
) -> PrecisionPlan:
    """Turn the user's `precision=` into what this device runs; a fallback carries a `note` to print.

    `bf16_supported` is `torch.cuda.is_bf16_supported()` on CUDA (ignored on CPU).
    """
    if isinstance(requested, PrecisionPlan):
        return requested
    name = _ALIASES.get(str(requested).lower())
    if name is None:
        raise problem(
            f"precision={requested!r} is not known",
            "Use '32' (full precision), 'bf16' (bfloat16 autocast) or '16' (float16 autocast with a "
            "gradient scaler, CUDA only)",
        )
    if device_type == "cuda" and name == "bf16" and not bf16_supported:
        return PrecisionPlan(
            "16", device_type, requested, "precision='bf16': this GPU has no bfloat16 support, so this "
            "run uses float16 autocast with a gradient scaler instead. Pass precision='16' to silence "
            "this, or '32' for full precision",
        )  # fmt: skip
    if device_type != "cuda" and name == "16":
        return PrecisionPlan(
            "bf16", device_type, requested, f"precision='16': float16 training needs CUDA (autocast with "
            f"a gradient scaler); this run is on {device_type}, so it uses bfloat16 autocast instead "
            "(the same 16-bit storage, with fp32's exponent range, so no scaler). Pass precision='bf16' "
            "to silence this, or '32' for full precision",
        )  # fmt: skip
    return PrecisionPlan(name, device_type, requested)


def make_scaler(plan: PrecisionPlan) -> torch.amp.GradScaler | None:
    """A gradient scaler for fp16 plans (on the plan's device type), else None."""
    return torch.amp.GradScaler(plan.device_type) if plan.scaler else None
