"""What the keywords of `s.save` / `s.load` become, and the per-rank part of a checkpoint.

    parts = split(dict(model=model, optimizer=opt, loader=train, step=12))
    # {"modules": {"model": ...}, "per_rank": {"loader": ...}, "shared": {"optimizer": ...},
    #  "values": {"step": 12}}

Kept apart from the save/load protocol (`ddpkit.checkpoint.checkpoints`) so that the rules for each kind of
object, and the per-rank files (RNG streams, loader position), read in one place.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from ddpkit.checkpoint import files
from ddpkit.checkpoint.divergence import checked, digest
from ddpkit.checkpoint.files import Found, Tensors
from ddpkit.data import ShardedLoader
from ddpkit.errors import problem


def rank_files(rank: int) -> tuple[str, str]:
    return f"rank-{rank:05d}.json", f"rank-{rank:05d}.safetensors"


def split(state: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Sort the keywords into modules, per-rank objects, shared objects and plain values."""
    parts: dict[str, dict[str, Any]] = {"modules": {}, "per_rank": {}, "shared": {}, "values": {}}
    for name, obj in state.items():
        if obj is None:
            continue
        if isinstance(obj, nn.Module):
            if name == "state":
                raise problem(
                    "a module cannot be saved under the name 'state' (a reserved file name)",
                    "Pick another keyword, e.g. model=",
                )
            parts["modules"][name] = obj
        elif per_rank_by_kind(obj) or marked_per_rank(obj):
            parts["per_rank"][name] = obj
        elif callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
            parts["shared"][name] = obj
        else:
            parts["values"][name] = obj
    return parts


def per_rank_by_kind(obj: Any) -> bool:
    """A loader, a generator or a stream position: each rank's own, whatever the ranks hold."""
    return isinstance(obj, (ShardedLoader, torch.Generator)) or stream_position(obj)


def marked_per_rank(obj: Any) -> bool:
    """`ddpkit_per_rank = True` on a stateful object: each rank's own state (`checkpoint.divergence`)."""
    stateful = callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))
    return stateful and getattr(obj, "ddpkit_per_rank", None) is True


def follow(parts: dict[str, dict[str, Any]], saved: Mapping[str, list[str]]) -> None:
    """At load: a stateful object goes where the checkpoint put it (per rank when its state differed
    between the ranks at save, or it was marked so), whatever it is marked now."""
    per_rank, shared = set(saved.get("per_rank", [])), set(saved.get("shared", []))
    for name in [n for n in parts["shared"] if n in per_rank]:
        parts["per_rank"][name] = parts["shared"].pop(name)
    for name, obj in list(parts["per_rank"].items()):
        if name in shared and not per_rank_by_kind(obj):
            parts["shared"][name] = parts["per_rank"].pop(name)


def stream_position(obj: Any) -> bool:
    """A loader or an iterable data set with a state: a position in this rank's own stream (torchdata's
    StatefulDataLoader, a Hugging Face IterableDataset), so each rank saves and loads its own."""
    stateful = callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))
    return stateful and isinstance(obj, (DataLoader, IterableDataset))


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def differing(
    shared: Mapping[str, Any], values: Mapping[str, Any], device: torch.device
) -> tuple[list[str], list[str]]:
    """Every rank, at the same point of a save: the shared objects (among `divergence.checked`) and the
    plain values (tensors, arrays, numbers, strings, containers of them) whose digest differs between
    the ranks, the same answer on every rank. One all-gather over the default group, 32 bytes a name
    (a value the same on every rank costs its digest, nothing more); none with one process. The names
    are the same on every rank: every rank passed the same keywords."""
    names = [*checked(shared), *values]
    if not names or not dist.is_initialized() or dist.get_world_size() == 1:
        return [], []
    states = [shared[n].state_dict() if n in shared else values[n] for n in names]
    words = [
        int.from_bytes(d[i : i + 8], "little", signed=True)
        for d in map(digest, states)
        for i in (0, 8, 16, 24)
    ]
    local = torch.tensor(words, dtype=torch.int64, device=device).reshape(len(names), 4)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    every = torch.stack(gathered).cpu()  # world x names x 4
    same = (every == every[0]).all(dim=2).all(dim=0).tolist()
    differ = [n for n, ok in zip(names, same, strict=True) if not ok]
    return [n for n in differ if n in shared], [n for n in differ if n not in shared]


def values_note(names: Collection[str]) -> str:
    """The one line a save prints (rank 0) when plain values differ between the ranks."""
    listed = ", ".join(f"{n}=" for n in sorted(names))
    return (
        f"ddpkit: {listed} kept per rank: the value differs between the ranks, so each rank's own is saved "
        "and each rank gets its own back from s.load (at the same world size; another refuses them)"
    )


def per_rank_tree(
    per_rank: Mapping[str, Any], tensors: Tensors, values: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """This rank's RNG streams, per-rank objects and the values that differ between the ranks (`values`,
    also saved once from rank 0 with the others) as JSON (tensors into `tensors`), taken now."""
    tree = {
        "rng": files.encode(rng_state(), tensors, "rng"),
        "objects": {n: files.encode(_per_rank_state(o), tensors, n) for n, o in per_rank.items()},
    }
    if values:
        tree["values"] = {n: files.encode(v, tensors, f"values/{n}") for n, v in values.items()}
    return tree


def own_values(
    rank: int, world_size: int, found: Found, values: Mapping[str, Any], asked: Collection[str]
) -> dict[str, Any]:
    """The values `s.load` returns: `values` (the defaults, then what rank 0 saved) with those saved per
    rank replaced by this rank's own. At another world size no rank's own is known for every rank: a
    value asked for (`asked`: passed to s.load) is refused, one not asked for is left out."""
    saved_world = int(found.manifest["world_size"])
    json_name, tensor_name = rank_files(rank if rank < saved_world else 0)
    kept = found.read_json(json_name).get("values") or {}
    if not kept:
        return dict(values)
    if saved_world != world_size:
        if wanted := sorted(set(kept) & set(asked)):
            listed = ", ".join(f"{n}=" for n in wanted)
            raise problem(
                f"{listed} differed between the ranks when the checkpoint was saved at world size "
                f"{saved_world}, so each rank's own was kept; at world size {world_size} no saved value "
                "is known to belong to each rank (rank 0's on every rank would be silently wrong)",
                f"Resume at world size {saved_world}, or leave {listed} out of s.load and compute it "
                "again after loading",
            )
        return {n: v for n, v in values.items() if n not in kept}
    return {**values, **files.decode(kept, found.read_tensors(tensor_name))}


def write_rank(tmp: Path, rank: int, tree: Any, tensors: Tensors) -> dict[str, Any]:
    """Write this rank's two files into the temporary checkpoint; their manifest entries."""
    json_name, tensor_name = rank_files(rank)
    return {
        tensor_name: files.write_tensors(tmp / tensor_name, tensors),
        json_name: files.write_json(tmp / json_name, tree),
    }


def _per_rank_state(obj: Any) -> Any:
    return obj.get_state() if isinstance(obj, torch.Generator) else obj.state_dict()


def restore_per_rank(rank: int, world_size: int, found: Found, per_rank: Mapping[str, Any]) -> list[str]:
    """Set this rank's RNG streams and per-rank objects; notes on what a new world size changed."""
    saved_world = int(found.manifest["world_size"])
    own = rank < saved_world
    json_name, tensor_name = rank_files(rank if own else 0)
    tree = found.read_json(json_name)
    tensors = found.read_tensors(tensor_name)
    if own and tree["rng"] is not None:  # None: a checkpoint converted from weights (no streams saved)
        set_rng_state(files.decode(tree["rng"], tensors))
    notes = []
    if saved_world != world_size:
        notes.append(f"world size {saved_world} -> {world_size}")
        if world_size > saved_world:
            notes.append(f"ranks {saved_world}..{world_size - 1} start fresh RNG streams")
        else:
            notes.append(f"the RNG streams of ranks {world_size}..{saved_world - 1} are dropped")
    for name, obj in per_rank.items():
        value = files.decode(tree["objects"][name], tensors)
        if saved_world != world_size and not per_rank_by_kind(obj):
            raise problem(
                f"{name}= ({type(obj).__name__}) was saved per rank at world size {saved_world} (its state "
                f"differed between the ranks, or it is marked ddpkit_per_rank = True); at world size "
                f"{world_size} no rank's saved state is known to belong to each rank (loading rank 0's on "
                "every rank would be silently wrong)",
                f"Resume at world size {saved_world}, or leave {name}= out of s.load to start it afresh, or "
                "set ddpkit_per_rank = False on it if one state for every rank is right (rank 0's is saved)",
            )
        if stream_position(obj) and saved_world != world_size:
            raise problem(
                f"{name}= ({type(obj).__name__}) holds a position in each rank's own stream, saved at world "
                f"size {saved_world}; at world size {world_size} the streams are split otherwise, so no "
                "rank's saved position belongs to it (loading rank 0's would repeat or skip data)",
                f"Resume at world size {saved_world}, or leave {name}= out of s.load to start its epoch "
                "afresh; s.loader(...) (ddpkit's loader) re-splits a stream at another world size",
            )
        if isinstance(obj, torch.Generator):
            if own:
                obj.set_state(value)
            continue
        obj.load_state_dict(value if own else dict(value, generator=None))
        if isinstance(obj, ShardedLoader):
            notes.append(describe_position(name, value, obj))
    return notes


def describe_position(name: str, old: Mapping[str, Any], loader: ShardedLoader) -> str:
    """The data position, and what a change of world size, accumulation or batch did to it.

    Like is compared with like: the true global batch (per rank x world x accumulation), so trading
    accumulation steps for ranks keeps it. Checkpoints from before `accumulation` was saved stored
    per rank x world as their global batch, which is the true one when they did not accumulate.
    """
    batch = loader.batch
    now, was_accumulation = batch.global_size, int(old.get("accumulation", 1))
    split_now = f"{batch.world_size} x {batch.per_rank} x {batch.accumulation}"
    was = f"{old['world_size']} x {old['per_rank_batch']} x {was_accumulation}"
    text = f"{name} at epoch {old['epoch']}, sample {old['samples']}"
    if loader.note:
        text = f"{text}; {loader.note}"
    if old["global_batch"] != now:
        return f"{text}; the global batch changed {old['global_batch']} -> {now}, so the rest differs"
    if (old["world_size"], was_accumulation) != (batch.world_size, batch.accumulation):
        return f"{text}, global batch {now} kept (ranks x per rank x accumulation: {was} -> {split_now})"
    return text
