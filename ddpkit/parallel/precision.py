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

One owner: `resolve_precision` is the only place that compares a request with what the device offers
(`offers`), and a `PrecisionPlan` is the only object that says what a precision means: the forward
context (`forward_context`), the loss scaler (`make_scaler`) and FSDP's `MixedPrecisionPolicy`
(`fsdp_policy`). A strategy that cannot apply a loss scale (FSDP) asks `resolve_precision` with
`loss_scale=False` and gets one error naming what was asked, what the device offers and what to pass.
Everything here is pure except `make_scaler`; `resolve_precision` is table-tested.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ddpkit.errors import problem

ALIASES = {
    "32": "32",
    "fp32": "32",
    "32-true": "32",
    "bf16": "bf16",
    "bf16-mixed": "bf16",
    "16": "16",
    "fp16": "16",
    "16-mixed": "16",
}
_DTYPES = {"32": None, "bf16": torch.bfloat16, "16": torch.float16}
NAMES = tuple(_DTYPES)  # what runs: "32", "bf16", "16"


def canonical(requested: str) -> str | None:
    """The precision name ("32", "bf16", "16") for any accepted spelling ("fp16", "bf16-mixed"...)."""
    return ALIASES.get(str(requested).lower())


def offers(device_type: str, *, bf16_supported: bool = True) -> tuple[str, ...]:
    """The precisions a device runs as asked: CPU has no fp16 training, pre-Ampere GPUs no bf16."""
    if device_type != "cuda":
        return ("32", "bf16")
    return ("32", "bf16", "16") if bf16_supported else ("32", "16")


def device_supports_bf16(device: torch.device) -> bool:
    """True off CUDA (CPU autocast runs bf16); on CUDA, what the GPU says."""
    return device.type != "cuda" or torch.cuda.is_bf16_supported()


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
    offered: tuple[str, ...] = ()  # what the device offers; empty when the plan was forced

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

    def forward_context(self) -> contextlib.AbstractContextManager:
        """The context a forward runs in: autocast to `autocast_dtype`, or nothing for "32"."""
        dtype = self.autocast_dtype
        return contextlib.nullcontext() if dtype is None else torch.autocast(self.device_type, dtype=dtype)

    def make_scaler(self) -> torch.amp.GradScaler | None:
        """A gradient scaler for fp16 (on the plan's device type), else None."""
        return torch.amp.GradScaler(self.device_type) if self.scaler else None

    def loss_scale(self) -> LossScale:
        """The loss scale the stepper drives: fp16's scaler, or a pass-through for the others."""
        return LossScale(self.make_scaler())

    def fsdp_policy(self) -> Any:
        """FSDP2's `MixedPrecisionPolicy`: bf16 compute, fp32 gradient reduction ("32": torch's default)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if self.name == "bf16":
            return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return MixedPrecisionPolicy()

    def describe(self) -> str:
        if self.name == "32":
            return "precision 32: fp32 everywhere"
        dtype = str(self.autocast_dtype).removeprefix("torch.")
        scaler = ", gradient scaler" if self.scaler else ""
        return f"precision {self.name}: autocast {dtype} on {self.device_type}, fp32 weights{scaler}"


FP32 = PrecisionPlan("32", "cpu")  # the plan where none is given: fp32, no autocast, no scaler


class LossScale:
    """fp16's loss scale, driven by its owner: scale the loss, unscale before clipping, step unless the
    gradients hold inf/nan (then the scale is lowered and the step skipped). Without a scaler ("32",
    "bf16") every call passes through, so the stepper has one path for every precision."""

    def __init__(self, scaler: torch.amp.GradScaler | None) -> None:
        self.scaler = scaler

    @property
    def active(self) -> bool:
        return self.scaler is not None

    def get_scale(self) -> float:
        return self.scaler.get_scale() if self.scaler is not None else 1.0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def unscale(
        self, optimizer: torch.optim.Optimizer, agree: Callable[[list[torch.Tensor]], None] | None = None
    ) -> None:
        """The gradients divided by the scale (before clipping reads them). `agree` receives the
        optimizer's overflow flags to make them every rank's (a sharded step whose ranks each hold only
        their share of the reduced gradients); the step then skips, or not, on every rank alike."""
        if self.scaler is None:
            return
        self.scaler.unscale_(optimizer)
        if agree is not None:
            # GradScaler keeps the flags unscale_ found per optimizer and has no public accessor: read
            # here, by the scaler's one owner, so no other module touches the scaler's state
            found = self.scaler._per_optimizer_states[id(optimizer)].get("found_inf_per_device", {})
            agree(list(found.values()))

    def step(self, optimizer: torch.optim.Optimizer, run: Callable[[Callable[[], Any]], Any]) -> bool:
        """`run(update)` runs the optimizer's update (the sharded step wraps it); True when fp16 skipped it
        for inf/nan gradients, in which case the scale was lowered."""
        scaler = self.scaler
        if scaler is None:
            run(optimizer.step)
            return False
        before = scaler.get_scale()
        run(lambda: scaler.step(optimizer))
        scaler.update()
        return scaler.get_scale() < before

    def state_dict(self) -> dict | None:
        return self.scaler.state_dict() if self.scaler is not None else None

    def load_state_dict(self, state: dict | None) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


def resolve_precision(
    requested: str | PrecisionPlan,
    device_type: str,
    *,
    bf16_supported: bool = True,
    loss_scale: bool = True,
    who: str = "strategy='fsdp'",
) -> PrecisionPlan:
    """Turn the user's `precision=` into what this device runs; a fallback carries a `note` to print.

    `bf16_supported` is `torch.cuda.is_bf16_supported()` on CUDA (ignored on CPU). `loss_scale=False`:
    the caller (`who`, FSDP) cannot apply a loss scale, so fp16 is an error here, never a fallback.
    """
    if isinstance(requested, PrecisionPlan):
        plan = requested
    else:
        plan = _resolve(requested, device_type, bf16_supported)
    if plan.scaler and not loss_scale:
        asked = plan.requested or plan.name
        offered = plan.offered or offers(plan.device_type, bf16_supported=bf16_supported)
        usable = [n for n in offered if n != "16"]
        fix = " or ".join(repr(n) for n in reversed(usable))
        raise problem(
            f"precision={asked!r} with {who} would run float16 with a loss scale, which {who} cannot "
            f"apply (each rank would check only its shard of the gradients for inf/nan, and ranks could "
            f"disagree); this {plan.device_type} device offers {', '.join(map(repr, offered))}",
            f"Pass precision={fix} to ddpkit.session",
        )
    return plan


def _resolve(requested: str, device_type: str, bf16_supported: bool) -> PrecisionPlan:
    name = canonical(requested)
    if name is None:
        raise problem(
            f"precision={requested!r} is not known",
            "Use '32' (full precision), 'bf16' (bfloat16 autocast) or '16' (float16 autocast with a "
            "gradient scaler, CUDA only)",
        )
    offered = offers(device_type, bf16_supported=bf16_supported)
    if device_type == "cuda" and name == "bf16" and not bf16_supported:
        return PrecisionPlan(
            "16",
            device_type,
            requested,
            "precision='bf16': this GPU has no bfloat16 support, so this "
            "run uses float16 autocast with a gradient scaler instead. Pass precision='16' to silence "
            "this, or '32' for full precision",
            offered,
        )
    if device_type != "cuda" and name == "16":
        return PrecisionPlan(
            "bf16",
            device_type,
            requested,
            f"precision='16': float16 training needs CUDA (autocast with "
            f"a gradient scaler); this run is on {device_type}, so it uses bfloat16 autocast instead "
            "(the same 16-bit storage, with fp32's exponent range, so no scaler). Pass precision='bf16' "
            "to silence this, or '32' for full precision",
            offered,
        )
    return PrecisionPlan(name, device_type, requested, None, offered)


def make_scaler(plan: PrecisionPlan) -> torch.amp.GradScaler | None:
    """A gradient scaler for fp16 plans (on the plan's device type), else None."""
    return plan.make_scaler()
