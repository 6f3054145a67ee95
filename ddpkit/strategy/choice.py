"""When FSDP is the right choice: the model state (parameters, gradients, optimizer state) against the
memory of one device. DDP keeps all of it on every rank; FSDP keeps 1/N but moves 3 collectives' bytes
per step against DDP's 2, and on the CPU ranks measured here ran 1.7x slower (docs/performance.md §7), so
it is worth it only when the replicated state does not fit. Activations are not counted: they need the
rest of the memory, hence the margin.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

FITS_SHARE = 0.8  # the model state may fill at most this share of a device; activations need the rest

# Per-parameter state tensors of torch's optimizers (Adam-like: two moments; SGD: momentum, if any).
_STATE_SLOTS = {
    "Adam": 2,
    "AdamW": 2,
    "NAdam": 2,
    "RAdam": 2,
    "Adamax": 2,
    "Adagrad": 1,
    "RMSprop": 1,
    "Adadelta": 2,
    "SGD": 1,
}


@dataclass(frozen=True)
class MemoryVerdict:
    """`fsdp`: the replicated model state does not fit; `text`: one line saying so, with the numbers."""

    state_bytes: int
    device_bytes: int
    world: int
    fsdp: bool
    text: str


def optimizer_slots(optimizer: torch.optim.Optimizer | type | str | None) -> int:
    """State tensors per parameter for a torch optimizer (2 for Adam-like, 1 for SGD with momentum)."""
    if optimizer is None:
        return 2  # assume Adam: the common and the larger case
    name = (
        optimizer if isinstance(optimizer, str) else getattr(optimizer, "__name__", type(optimizer).__name__)
    )
    slots = _STATE_SLOTS.get(name, 2)
    if name == "SGD" and isinstance(optimizer, torch.optim.Optimizer):
        slots = int(any(g.get("momentum", 0) for g in optimizer.param_groups))
    return slots


def model_state_bytes(module: nn.Module, slots: int = 2) -> int:
    """Parameters + gradients + `slots` optimizer tensors per trainable parameter, in bytes."""
    params = [p for p in module.parameters() if p.requires_grad]
    per_param = sum(p.numel() * p.element_size() for p in params)
    return per_param * (2 + slots)


def device_bytes(device: torch.device, ranks_per_device: int = 1) -> int:
    """Memory one rank may use: the GPU's, or this machine's RAM shared by its ranks."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory // ranks_per_device
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // ranks_per_device


def verdict(state_bytes: int, device_bytes: int, world: int) -> MemoryVerdict:
    """DDP when the replicated state fits in FITS_SHARE of a device, FSDP when it does not."""
    gb = 1e9
    fsdp = state_bytes > FITS_SHARE * device_bytes
    head = (
        f"model state {state_bytes / gb:.2f} GB per rank (parameters, gradients, optimizer state; "
        f"activations not counted) of {device_bytes / gb:.1f} GB per rank"
    )
    if fsdp:
        text = (
            f"{head}: does not fit with DDP; use strategy='fsdp' ({state_bytes / world / gb:.2f} GB per "
            f"rank at {world} ranks)"
        )
    else:
        text = f"{head}: DDP fits; FSDP not needed (it shards memory at the cost of more communication)"
    return MemoryVerdict(state_bytes, device_bytes, world, fsdp, text)
