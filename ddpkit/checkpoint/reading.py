"""A checkpoint read offline, one tensor at a time: no process group, no torch.distributed set up.

    ckpt = reading.read("runs/ckpt")                   # values, weights, objects, every rank's part: whole
    found = reading.open_checked("runs/ckpt")          # the newest checkpoint; refused if a checksum fails
    for key, tensor in reading.weights(found, "model"):  # whole-model file or FSDP's DCP shards alike
        ...                                              # only this one tensor is in memory

What `inspect` and `convert` share. A whole-model file (`model.safetensors`, written under DDP or one
process) is read by seeking to each tensor's bytes (no memory map, so the pages of tensors already
handed out are not kept resident). FSDP's shards (`dcp/`) are read with torch.distributed.checkpoint's
offline load (`no_dist=True`) into one full-size tensor at a time: DCP stitches that tensor's pieces from
every rank's file, whatever the world size that wrote them. The DCP metadata goes through ddpkit's
restricted unpickler (`checkpoint.dcp.MetadataUnpickler`), as on any load.
"""

from __future__ import annotations

import io
import json
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ddpkit.checkpoint import dcp as checkpoint_dcp
from ddpkit.checkpoint import files
from ddpkit.checkpoint.files import CheckpointError, Found

DTYPES = {code: dtype for dtype, code in files.SAFETENSORS_DTYPES.items()}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's name, shape and dtype, known without reading its bytes."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


def resolve(path: str | Path) -> tuple[Path, list[Path]]:
    """The checkpoint `path` names (itself, or the newest under a root) and the root's others, newest
    first. Not verified here: `inspect` reports what fails, `open_checked` refuses it."""
    path = Path(path)
    if files.is_checkpoint(path):
        return path, []
    found = files.candidates(path)
    if not found:
        what = (
            files.foreign(path)
            or f"{path} holds no ddpkit checkpoint (no ckpt-NNNNNN/ folder with a manifest)"
        )
        raise CheckpointError(
            f"{what}. Pass a folder that s.save wrote into, or one of its ckpt-NNNNNN/ folders"
        )
    return found[0], found[1:]


def open_checked(path: str | Path) -> Found:
    """The checkpoint at `path` (the newest under a root) with every checksum verified, or a refusal
    naming the file that fails, and which older checkpoint verifies, if any. Never falls back silently:
    a conversion of an older checkpoint than asked for would look like a good one."""
    chosen, older = resolve(path)
    try:
        return files.verify(chosen)
    except CheckpointError as err:
        good = next((p for p in older if _verifies(p)), None)
        alternative = (
            f"{good} verifies: pass it to use that one"
            if good is not None
            else "no older checkpoint beside it verifies"
        )
        raise CheckpointError(
            f"refused {chosen}: {str(err).rstrip('.')}. A checkpoint whose checksums do not hold is not "
            f"read or converted (its numbers may be silently wrong); {alternative}, or restore this one "
            "from a backup"
        ) from None


def _verifies(path: Path) -> bool:
    try:
        files.verify(path)
    except CheckpointError:
        return False
    return True


def check_files(path: Path) -> tuple[dict[str, Any] | None, list[str], int]:
    """Every problem of the checkpoint at `path` (not only the first), its manifest if that parses,
    and the bytes of the files it lists."""
    try:
        manifest = json.loads((path / files.MANIFEST).read_text())
    except (OSError, ValueError, UnicodeDecodeError) as err:
        return None, [f"{path / files.MANIFEST} cannot be read ({err})"], 0
    problems = []
    try:
        files.verify_manifest(path, manifest)
    except CheckpointError as err:
        problems.append(str(err))
    entries = manifest.get("files", {}) if isinstance(manifest, dict) else {}
    for name, entry in sorted(entries.items()):
        try:
            files.check_file(path / name, entry)
        except CheckpointError as err:
            problems.append(str(err))
    return manifest, problems, sum(int(e.get("bytes", 0)) for e in entries.values())


# -- what a file holds ------------------------------------------------------------------------------
def safetensors_entries(path: Path) -> tuple[list[TensorInfo], dict[str, tuple[int, int]], int]:
    """A safetensors file's tensors (in file order), their byte ranges, and where the data starts."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    ordered = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
    infos = [TensorInfo(k, tuple(v["shape"]), DTYPES[v["dtype"]]) for k, v in ordered]
    return infos, {k: tuple(v["data_offsets"]) for k, v in ordered}, 8 + length


def read_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a safetensors file, one at a time, each read into its own memory."""
    infos, offsets, base = safetensors_entries(path)
    with open(path, "rb", buffering=0) as f:
        for info in infos:
            start, stop = offsets[info.key]
            tensor = torch.empty(info.shape, dtype=info.dtype)
            if stop > start:
                f.seek(base + start)
                view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
                while view:
                    got = f.readinto(view)
                    if not got:
                        raise CheckpointError(f"{path} ends inside {info.key}: the file is truncated")
                    view = view[got:]
            yield info.key, tensor


def dcp_metadata(found: Path) -> Any:
    """The DCP metadata of a sharded checkpoint (restricted unpickler), or None without `dcp/`."""
    meta = found / checkpoint_dcp.DIRECTORY / ".metadata"
    if not meta.is_file():
        return None
    return checkpoint_dcp.MetadataUnpickler(io.BytesIO(meta.read_bytes())).load()


def dcp_tensors(metadata: Any, prefix: str) -> list[TensorInfo]:
    """The tensors DCP holds under `prefix.` (full shapes, whatever the world size that wrote them)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out = []
    for key, item in metadata.state_dict_metadata.items():
        if key.startswith(prefix + ".") and isinstance(item, TensorStorageMetadata):
            out.append(TensorInfo(key[len(prefix) + 1 :], tuple(item.size), item.properties.dtype))
    return out


def read_dcp(found: Path, prefix: str, infos: list[TensorInfo]) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor under `prefix.` in FSDP's shards, whole, one at a time (DCP's offline load)."""
    from torch.distributed.checkpoint import load as dcp_load

    reader = checkpoint_dcp.safe_reader(found / checkpoint_dcp.DIRECTORY)
    for info in infos:
        tensor = torch.empty(info.shape, dtype=info.dtype)
        with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": offline is the point
            warnings.simplefilter("ignore", UserWarning)
            dcp_load({f"{prefix}.{info.key}": tensor}, storage_reader=reader, no_dist=True)
        yield info.key, tensor


# -- the models of a checkpoint ---------------------------------------------------------------------
def model_names(found: Found) -> list[str]:
    """The names the checkpoint's models were saved under (`s.save(model=...)` -> "model")."""
    objects = found.manifest.get("objects", {})
    names = list(objects.get("modules", []))
    metadata = dcp_metadata(found.path) if objects.get("sharded") else None
    for name in objects.get("sharded", []):
        if metadata is not None and not is_optimizer(metadata, name):
            names.append(name)
    return sorted(names)


def is_optimizer(metadata: Any, name: str) -> bool:
    """In DCP's keys an optimizer is `name.state.*` and `name.param_groups.*`; a model is its FQNs."""
    return any(
        k.startswith((f"{name}.state.", f"{name}.param_groups.")) for k in metadata.state_dict_metadata
    )


def pick_model(found: Found, name: str | None) -> str:
    names = model_names(found)
    if name is not None and name in names:
        return name
    if name is None and len(names) == 1:
        return names[0]
    listed = ", ".join(names) or "none"
    raise CheckpointError(
        f"{found.path} holds the models {listed}; "
        + (f"not {name!r}. " if name is not None else "which one? ")
        + "Pass --model NAME (the keyword it was saved under, e.g. model= in s.save)"
    )


def weight_infos(found: Found, name: str) -> list[TensorInfo]:
    """The tensors of model `name`, without reading them (a whole-model file or DCP's metadata)."""
    if f"{name}.safetensors" in found.manifest["files"]:
        return safetensors_entries(found.file(f"{name}.safetensors"))[0]
    metadata = dcp_metadata(found.path)
    if metadata is None:
        raise CheckpointError(f"{found.path} has no weights of {name!r}")
    return dcp_tensors(metadata, name)


def weights(found: Found, name: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Model `name`'s full tensors, one at a time, from whichever strategy wrote them."""
    if f"{name}.safetensors" in found.manifest["files"]:
        yield from read_safetensors(found.file(f"{name}.safetensors"))
    else:
        yield from read_dcp(found.path, name, weight_infos(found, name))


@dataclass(frozen=True)
class Contents:
    """What one checkpoint holds, read offline (`read`): no session, no process group.

    `values`: the plain values given to `s.save` (step, the model's shape arguments, a tracker's run id),
    whole, with those kept per rank (they differed between the ranks) as `rank`'s own; `weights`: each
    model's full tensors by its keyword in `s.save`; `objects`: each shared object's `state_dict()`
    (an optimizer, a scheduler); `ranks`: every rank's own part (its RNG states under "rng", its per-rank
    objects under "objects", its own values under "values")."""

    path: Path
    world_size: int
    values: dict[str, Any]
    weights: dict[str, dict[str, torch.Tensor]]
    objects: dict[str, Any]
    ranks: list[dict[str, Any]]


def read(path: str | Path, *, rank: int = 0) -> Contents:
    """The checkpoint at `path` (the newest valid one under a root), every checksum verified, read whole:

        ckpt = ddpkit.checkpoint.reading.read("runs/ckpt")
        model = GPT(**ckpt.values["model_args"])          # the values a save was given, whole
        model.load_state_dict(ckpt.weights["model"])      # whole-model file or FSDP's shards alike

    `rank`: whose own values stand in `values` where they differed between the ranks (rank 0's
    otherwise are in the shared part too). Everything is read into memory: `weights` streams one model's
    tensors one at a time instead."""
    found = open_checked(path)
    manifest = found.manifest
    listed = manifest.get("files", {})
    shared = found.read_json("state.json") if "state.json" in listed else {}
    tensors = found.read_tensors("state.safetensors") if "state.safetensors" in listed else {}
    world = int(manifest.get("world_size", 1))
    ranks = []
    for r in range(world):
        name = f"rank-{r:05d}"  # ddpkit.checkpoint.state.rank_files
        tree = found.read_json(f"{name}.json") if f"{name}.json" in listed else {}
        own = found.read_tensors(f"{name}.safetensors") if f"{name}.safetensors" in listed else {}
        ranks.append(files.decode(tree, own))
    values = files.decode(shared.get("values", {}), tensors)
    if 0 <= rank < len(ranks):
        values.update(ranks[rank].get("values") or {})
    return Contents(
        path=found.path,
        world_size=world,
        values=values,
        weights={name: dict(weights(found, name)) for name in model_names(found)},
        objects=files.decode(shared.get("objects", {}), tensors),
        ranks=ranks,
    )
