"""Per-rank state never silently shared: which "shared" objects of a save differ between the ranks.

    s.save(root, model=model, optimizer=opt, stream=my_stream)   # my_stream.state_dict() differs by rank
    # ddpkit: stream= is saved per rank: its state differs between the ranks ...

A save keeps one copy (global rank 0's) of an object with `state_dict`/`load_state_dict`, because in
data-parallel training an optimizer, a scheduler or a scaler is the same on every rank. A user's own
object need not be (a per-rank position in a stream of the user's own): rank 0's copy would come back on
every rank, silently. So each such object's state is hashed on every rank and the digests are compared
in one small all-gather (32 bytes an object, once per save); an object that differs is saved per rank,
like a loader, and one line says so. The same object at load follows what the checkpoint says.

Marking, which skips the check: `ddpkit_per_rank = True` on the object or its class saves it per rank
always; `ddpkit_per_rank = False` saves rank 0's always (state that may differ but should not travel,
e.g. a cache). Optimizers, LR schedulers and gradient scalers are not hashed (the same on every rank by
construction, and an optimizer's moments can be gigabytes); mark one `ddpkit_per_rank = True` if yours
keeps per-rank state.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.checkpoint import files
from ddpkit.checkpoint.files import Tensors

MARK = "ddpkit_per_rank"
_SAME_BY_CONSTRUCTION = (torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler, torch.amp.GradScaler)


def marked(obj: Any) -> bool | None:
    """The object's own answer (`ddpkit_per_rank` True or False), or None: check it at save."""
    value = getattr(obj, MARK, None)
    return value if isinstance(value, bool) else None


def checked(shared: Mapping[str, Any]) -> list[str]:
    """The shared objects whose state is compared across ranks: unmarked, and not of a kind that is
    the same on every rank by construction."""
    return [n for n, o in shared.items() if marked(o) is None and not isinstance(o, _SAME_BY_CONSTRUCTION)]


def digest(state: Any) -> bytes:
    """SHA-256 of a state dict: its structure and plain values as JSON, then each tensor's bytes."""
    tensors = Tensors()
    tree = files.encode(state, tensors, "state")
    h = hashlib.sha256(json.dumps(tree, sort_keys=True, allow_nan=True).encode())
    for key in sorted(tensors):
        t = tensors[key].detach().to("cpu").contiguous()
        h.update(f"{key}:{t.dtype}:{list(t.shape)}".encode())
        if t.numel():
            h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return h.digest()


def differing(shared: Mapping[str, Any], device: torch.device) -> list[str]:
    """Every rank, at the same point of a save: the names among `checked(shared)` whose state differs
    between the ranks (the same answer on every rank). One all-gather over the default group; none
    when there is nothing to check (the names are the same on every rank: every rank passed them)."""
    names = checked(shared)
    if not names or not dist.is_initialized() or dist.get_world_size() == 1:
        return []
    words = [
        int.from_bytes(d[i : i + 8], "little", signed=True)
        for d in (digest(shared[n].state_dict()) for n in names)
        for i in range(0, 32, 8)
    ]
    local = torch.tensor(words, dtype=torch.int64, device=device).reshape(len(names), 4)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    every = torch.stack(gathered).cpu()  # world x names x 4
    same = (every == every[0]).all(dim=2).all(dim=0)
    return [n for n, ok in zip(names, same.tolist(), strict=True) if not ok]


def note(name: str, obj: Any) -> str:
    """The one line a save prints the first time `name` goes per rank."""
    return (
        f"ddpkit: {name}= ({type(obj).__name__}) is saved per rank: its state differs between the ranks "
        f"(one copy would bring rank 0's back on every rank); a load at another world size refuses it. "
        f"Set {MARK} = True on it to say so, or False to keep one copy (rank 0's)"
    )
