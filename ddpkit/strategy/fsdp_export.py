"""The full weights of an FSDP model as one safetensors file, streamed: one tensor whole at a time.

    fsdp_export.write(model, "runs/model.safetensors", rank)   # every rank calls it (a collective)

`get_model_state_dict(full_state_dict=True, cpu_offload=True)` (what `s.export` used) gathers the
whole model into global rank 0's memory before the file is written, so the rank that writes must hold
the model whole, the very thing FSDP exists to avoid. The safetensors header needs only names, dtypes
and shapes, which the sharded state dict knows; so rank 0 writes the header first, then each tensor's
bytes at their offset as soon as it is gathered (`DTensor.full_tensor()`, one all-gather per tensor),
and frees it. Peak: the rank's shards plus one full tensor. The file is what
`safetensors.torch.save_file` would write for the same tensors (same header layout, 8-byte aligned).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ddpkit.checkpoint.files import safetensors_header


def write(model: nn.Module, path: str | Path, rank: int) -> int:
    """Write the model's full state dict to `path` (global rank 0 writes; all ranks must call); the
    number of tensors. Written to a temporary name and renamed, so a reader never sees half a file."""
    state = model.state_dict()  # sharded DTensors and whole buffers: nothing gathered yet
    target = Path(path)
    partial = target.with_name(f".{target.name}.tmp")
    out = None
    if rank == 0:
        target.parent.mkdir(parents=True, exist_ok=True)
        out = open(partial, "wb")  # noqa: SIM115 (closed below, also on errors)
    try:
        if out is not None:
            out.write(safetensors_header((name, state[name]) for name in sorted(state)))  # by name
        for name in sorted(state):
            t = state[name].detach()
            whole = t.full_tensor() if hasattr(t, "full_tensor") else t  # all ranks: one tensor gathered
            if out is not None:
                out.write(whole.cpu().contiguous().reshape(-1).view(torch.uint8).numpy())  # no copy
            del whole
    finally:
        if out is not None:
            out.close()
    if rank == 0:
        partial.replace(target)
    return len(state)
