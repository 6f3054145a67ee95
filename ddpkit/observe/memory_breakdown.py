"""Where a training step's peak memory goes, as a typed value, and its one-screen text.

    b = Breakdown.from_snapshot(tracker.get_tracker_snapshot("peak"))   # MemTracker or FSDPMemTracker
    print(b.text(device))

`Breakdown` is the unit of `ddpkit plan --memory` (`ddpkit.plan.memory` fills it from one step run on
fake tensors) and is meant for any other place that asks where a step's peak went: a tracker run on a
live step's real tensors gives the same snapshot, so the same categories and the same rendering. The
categories are torch's (`torch.distributed._tools.mem_tracker._MemRefType` and
`fsdp2_mem_tracker._FSDPRefType`) folded into the ones a user decides with:

| category | torch's trackers | what changes it |
|---|---|---|
| parameters | Parameter, Buffer; FSDP: Sharded Param, Buffer | FSDP (1/N), precision of the stored weights |
| gradients | Gradient; FSDP: Sharded Grad | FSDP (1/N) |
| optimizer state | Optstate | FSDP or the sharded step (1/N), the optimizer (Adam: 2 per parameter) |
| activations | Activation, Inputs | micro-batch, sequence length, activation checkpointing, bf16 |
| FSDP buffers | Unsharded Param, Unsharded Grad, All Gather, Reduce Scatter | the largest FSDP unit |
| temporaries | Temp, Other | micro-batch (the backward's scratch, e.g. the logits' gradient) |

On top of the tracked peak, two stated figures: the allocator's allowance (fragmentation and cached
blocks, a fraction of the peak, `ddpkit.plan.devices`) and what the runtime holds before the first
tensor (the CUDA context); neither is hidden in another row.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "fsdp_buffers", "temporaries")
LABELS = {
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer_state": "optimizer state",
    "activations": "activations",
    "fsdp_buffers": "FSDP all-gather buffers",
    "temporaries": "temporaries",
}
_FOLD = {  # torch's category name (its enum's value) -> ours
    "Parameter": "parameters",
    "Buffer": "parameters",
    "Sharded Param": "parameters",
    "Gradient": "gradients",
    "Sharded Grad": "gradients",
    "Optstate": "optimizer_state",
    "OptState": "optimizer_state",
    "Activation": "activations",
    "Inputs": "activations",
    "Unsharded Param": "fsdp_buffers",
    "Unsharded Grad": "fsdp_buffers",
    "All Gather": "fsdp_buffers",
    "Reduce Scatter": "fsdp_buffers",
    "Temp": "temporaries",
    "Other": "temporaries",
}


def gib(n: float) -> str:
    """Bytes as GiB with a precision that suits the size (MiB below 1 GiB)."""
    if abs(n) < 1 << 30:
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n / (1 << 30):.2f} GiB"


@dataclass(frozen=True, kw_only=True)
class Breakdown:
    """The bytes live at a step's peak, by category; `allowance` and `reserved` are added, not tracked.

    `peak` is the tracked total at the peak (the sum of the categories); `total` adds the allocator's
    allowance and the runtime's reserve: what the device must hold.
    """

    parameters: int = 0
    gradients: int = 0
    optimizer_state: int = 0
    activations: int = 0
    fsdp_buffers: int = 0
    temporaries: int = 0
    allowance: int = 0
    reserved: int = 0
    notes: tuple[str, ...] = field(default_factory=tuple)

    @classmethod
    def from_snapshot(cls, snapshot: Mapping[Any, Mapping[Any, int]]) -> Breakdown:
        """From a tracker's `get_tracker_snapshot("peak")` ({device: {category: bytes, "Total": n}}),
        all devices summed (one rank uses one device)."""
        sums: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        for per_device in snapshot.values():
            for key, value in per_device.items():
                name = getattr(key, "value", key)
                if name == "Total":
                    continue
                if name not in _FOLD:
                    raise ValueError(f"unknown tracker category {name!r}")
                sums[_FOLD[name]] += int(value)
        return cls(
            parameters=sums["parameters"],
            gradients=sums["gradients"],
            optimizer_state=sums["optimizer_state"],
            activations=sums["activations"],
            fsdp_buffers=sums["fsdp_buffers"],
            temporaries=sums["temporaries"],
        )

    @property
    def model_state(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state

    @property
    def peak(self) -> int:
        return sum(getattr(self, c) for c in CATEGORIES)

    @property
    def total(self) -> int:
        return self.peak + self.allowance + self.reserved

    def with_device(self, allowance: float, reserved: int, *notes: str) -> Breakdown:
        """This breakdown with the device's allowance (a fraction of the peak) and reserve added."""
        from dataclasses import replace

        return replace(
            self, allowance=round(self.peak * allowance), reserved=reserved, notes=(*self.notes, *notes)
        )

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "notes": list(self.notes), "peak": self.peak, "total": self.total}

    def rows(self) -> list[tuple[str, int]]:
        """(label, bytes) for the categories, the allowance and the reserve, in the rendering's order."""
        out = [(LABELS[c], getattr(self, c)) for c in CATEGORIES]
        return [*out, ("allocator allowance", self.allowance), ("runtime reserve", self.reserved)]

    def text(self, capacity: int | None = None, title: str = "peak per rank") -> str:
        """One screen: a row per category with its share of the total, then the total against the
        device's `capacity` (bytes) when given."""
        total = self.total or 1
        width = max(len(label) for label, _ in self.rows())
        lines = [title]
        for label, n in self.rows():
            if n or label in ("activations", "parameters"):
                lines.append(f"  {label:<{width}}  {gib(n):>11}  {n / total:4.0%}")
        lines.append(f"  {'tracked peak':<{width}}  {gib(self.peak):>11}")
        verdict = ""
        if capacity is not None:
            verdict = f"  {'fits' if self.total <= capacity else 'does NOT fit'} in {gib(capacity)}"
        lines.append(f"  {'total':<{width}}  {gib(self.total):>11}{verdict}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)
