"""`ddpkit checkpoint inspect DIR`: what a checkpoint holds, in one screen, with no process group.

    $ ddpkit checkpoint inspect runs/ckpt
    runs/ckpt/ckpt-000004 (newest of 2 in runs/ckpt)
      step 40, written by fsdp at world size 2 (torch 2.13.0), 2026-11-28 02:40 UTC
      checksums: all 9 files hold (412.3 KiB)
      model (sharded: dcp/): 10 tensors, 4.6 KiB, float32
        0.weight  [16, 8]  float32
        ...
      shards (each rank's file, SHA-256 at the save):
        rank 0  dcp/__0_0.distcp  3.1 KiB  5f1c09e2a7b4d3e8  ok

Read from the manifest, the safetensors headers, the JSON files and DCP's metadata: no tensor's bytes
are loaded (the checksums read every file once, in 1 MiB pieces), so it answers for a model of any size.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ddpkit.checkpoint import files, reading
from ddpkit.checkpoint.reading import TensorInfo
from ddpkit.parallel.layout import Layout

SHOWN = 12  # tensors listed per model without --all


def report(path: str | Path, *, all_tensors: bool = False, whole_values: bool = False) -> tuple[str, bool]:
    """The text `inspect` prints, and whether every checksum holds; `whole_values`: each value on a line of
    its own, whole (its JSON), instead of cut to one line."""
    chosen, older = reading.resolve(path)
    manifest, problems, size = reading.check_files(chosen)
    where = f" (newest of {len(older) + 1} in {chosen.parent})" if Path(path) != chosen else ""
    lines = [f"{chosen}{where}"]
    if manifest is None or not isinstance(manifest, dict):
        return "\n".join([*lines, *(f"  DAMAGED: {p}" for p in problems)]), False
    lines.append("  " + _header(manifest))
    count = len(manifest.get("files", {}))
    if problems:
        lines.append(f"  checksums: {len(problems)} of {count} files FAIL; do not use this checkpoint:")
        lines += [f"    {p}" for p in problems]
    else:
        lines.append(f"  checksums: all {count} files hold ({files.human_size(size)})")
    found = files.Found(chosen, manifest)
    objects = manifest.get("objects", {})
    metadata = reading.dcp_metadata(chosen) if objects.get("sharded") else None
    for name in objects.get("modules", []):
        if f"{name}.safetensors" in manifest.get("files", {}):
            infos = reading.safetensors_entries(found.file(f"{name}.safetensors"))[0]
            lines += _tensors(f"{name} (whole: {name}.safetensors)", infos, all_tensors)
    for name in objects.get("sharded", []):
        if metadata is None:
            continue
        infos = reading.dcp_tensors(metadata, name)
        if reading.is_optimizer(metadata, name):
            lines.append(f"  {name} (sharded optimizer: dcp/): {_moments(infos)}")
        else:
            lines += _tensors(f"{name} (sharded: dcp/)", infos, all_tensors)
    lines += _shards(chosen, manifest, problems)
    lines += _shared(found, objects, whole_values)
    lines += _per_rank(found, objects, int(manifest.get("world_size", 1)))
    return "\n".join(lines), not problems


def _shards(path: Path, manifest: Mapping[str, Any], problems: list[str]) -> list[str]:
    """Each rank's shard file (FSDP, HSDP) with its size and the SHA-256 recorded as it was written, and
    whether the file still holds it (FAIL: the load refuses the checkpoint, naming that rank)."""
    shards = sorted(
        (rank, name, entry)
        for name, entry in manifest.get("files", {}).items()
        if (rank := files.shard_rank(name)) is not None
    )
    if not shards:
        return []
    lines = ["  shards (each rank's file, SHA-256 at the save):"]
    for rank, name, entry in shards:
        failed = any(str(path / name) in p for p in problems)
        size, digest = files.human_size(int(entry.get("bytes", 0))), str(entry.get("sha256", "?"))[:16]
        lines.append(f"    rank {rank}  {name}  {size}  {digest}  {'FAIL' if failed else 'ok'}")
    return lines


def _header(manifest: Mapping[str, Any]) -> str:
    step = manifest.get("step")
    created = manifest.get("created")
    when = (
        datetime.datetime.fromtimestamp(created, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        if isinstance(created, (int, float))
        else "time unknown"
    )
    head = f"step {step}, " if step is not None else ""
    strategy = manifest.get("strategy", "ddp")
    who = "one process" if strategy == "single" else strategy
    layout = Layout.from_dict(manifest["layout"]) if isinstance(manifest.get("layout"), Mapping) else None
    if layout is not None and layout.meshed:  # a mesh of two dimensions or more: say its shape
        who = f"{who} ({layout.describe()})"
    world, torch_version = manifest.get("world_size"), manifest.get("torch", "?")
    return f"{head}written by {who} at world size {world} (torch {torch_version}), {when}"


def _tensors(title: str, infos: list[TensorInfo], all_tensors: bool) -> list[str]:
    dtypes = sorted({str(i.dtype).removeprefix("torch.") for i in infos})
    total = sum(i.nbytes for i in infos)
    params = sum(i.nbytes // i.dtype.itemsize for i in infos)
    lines = [
        f"  {title}: {len(infos)} tensors, {params:,} numbers, {files.human_size(total)}, {'/'.join(dtypes)}"
    ]
    shown = infos if all_tensors else infos[:SHOWN]
    width = max((len(i.key) for i in shown), default=0)
    for i in shown:
        lines.append(f"    {i.key:<{width}}  {list(i.shape)!s:<14} {str(i.dtype).removeprefix('torch.')}")
    if len(shown) < len(infos):
        lines.append(f"    ... {len(infos) - len(shown)} more (--all lists them)")
    return lines


def _moments(infos: list[TensorInfo]) -> str:
    kinds = sorted({i.key.rsplit(".", 1)[-1] for i in infos if i.key.startswith("state.")})
    total = sum(i.nbytes for i in infos)
    return f"{len(infos)} tensors ({', '.join(kinds) or 'no state yet'}), {files.human_size(total)}"


def _shared(found: files.Found, objects: Mapping[str, Any], whole: bool = False) -> list[str]:
    """Optimizers, schedulers and other shared objects (state.json), and the plain values."""
    if "state.json" not in found.manifest.get("files", {}):
        return []
    tree = json.loads(found.file("state.json").read_text())
    header = {}
    if "state.safetensors" in found.manifest["files"]:
        header = {i.key: i for i in reading.safetensors_entries(found.file("state.safetensors"))[0]}
    lines = []
    for name in objects.get("shared", []):
        value = tree.get("objects", {}).get(name)
        own = [i for k, i in header.items() if k == name or k.startswith(name + "/")]
        size = f", {len(own)} tensors, {files.human_size(sum(i.nbytes for i in own))}" if own else ""
        lines.append(f"  {name} (one copy, rank 0's): {_summary(value)}{size}")
    values = tree.get("values", {})
    if values and whole:
        lines.append("  values:")
        lines += [f"    {k} = {json.dumps(v, sort_keys=True)}" for k, v in values.items()]
    elif values:
        shown = ", ".join(f"{k}={_short(v)}" for k, v in values.items())
        lines.append(f"  values: {shown}")
    return lines


def _summary(tree: Any) -> str:
    """An optimizer's param groups (lr, how many parameters), or a short view of any other state."""
    if isinstance(tree, dict) and isinstance(tree.get("param_groups"), list):
        groups = tree["param_groups"]
        dicts = [g for g in groups if isinstance(g, dict)]
        lrs = sorted({float(g["lr"]) for g in dicts if isinstance(g.get("lr"), (int, float))})
        params = sum(len(g.get("params", [])) for g in dicts)
        state = tree.get("state", {})
        kept = len(state.get("__items__", state)) if isinstance(state, dict) else 0
        lr = ", ".join(f"{x:g}" for x in lrs)
        return f"{len(groups)} param group(s), {params} parameters, lr {lr}, state for {kept} of them"
    return _short(tree)


def _per_rank(found: files.Found, objects: Mapping[str, Any], world: int) -> list[str]:
    """Each per-rank object's state on each rank (a loader's epoch and sample), and the RNG streams."""
    lines = []
    trees = []
    for rank in range(world):
        name = f"rank-{rank:05d}.json"
        if name in found.manifest.get("files", {}):
            trees.append(json.loads(found.file(name).read_text()))
    for name in objects.get("per_rank", []):
        states = [t.get("objects", {}).get(name) for t in trees]
        lines.append(
            f"  {name} (per rank): " + "; ".join(f"rank {r}: {_position(s)}" for r, s in enumerate(states))
        )
    seeded = sum(1 for t in trees if t.get("rng") is not None)
    kinds = "torch, numpy, Python" + (", CUDA" if _has_cuda(trees) else "")
    lines.append(f"  RNG streams ({kinds}): {seeded} of {world} ranks")
    return lines


def _has_cuda(trees: list[Any]) -> bool:
    return any(isinstance(t.get("rng"), dict) and "cuda" in t["rng"] for t in trees)


def _position(state: Any) -> str:
    if isinstance(state, dict) and "epoch" in state and "samples" in state:
        return f"epoch {state['epoch']}, sample {state['samples']}"
    return _short(state)


def _short(value: Any, limit: int = 60) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
