"""The checkpoint directory on disk: no pickle, atomic, verifiable. Nothing here knows about ranks.

    runs/ckpt/                      the root a user passes to `s.save` / `s.load`
      ckpt-000004/                  one complete checkpoint (renamed into place when finished)
        model.safetensors           weights of each nn.Module, keys without `module.` (plain torch loads them)
        state.safetensors           tensors of the replicated objects (optimizer, scheduler, ...)
        state.json                  their structure and the plain values (step, epoch, ...)
        rank-00001.safetensors      per-rank tensors (RNG states, loader generator)
        rank-00001.json             per-rank structure (numpy and Python RNG, loader position)
        dcp/                        under FSDP: model and optimizer shards (`ddpkit.checkpoint.dcp`)
        manifest.json               written last: every file's size and SHA-256, plus its own checksum
      .ckpt-000005.tmp/             a checkpoint being written (or left by a crash): never read

Why this shape: a directory renamed into place is atomic on POSIX file systems, so a crash leaves
either the old set or the new one; the manifest makes truncation and bit flips detectable; tensors go
through safetensors and everything else through JSON, so loading never unpickles anything (a planted
pickle is just bytes that fail to parse).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from ddpkit.errors import DdpkitError, problem

FORMAT = "ddpkit-checkpoint/1"
MANIFEST = "manifest.json"
_NAME = re.compile(r"^ckpt-(\d{6,})$")
_TMP = re.compile(r"^\.ckpt-(\d{6,})\.tmp$")
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$|^dcp/(\.metadata|__\d+_\d+\.distcp)$")
_SHARD = re.compile(r"^dcp/__(\d+)_\d+\.distcp$")  # one rank's FSDP/HSDP shards (DCP's name: __<rank>_0)


SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def safetensors_header(tensors: Any, metadata: Mapping[str, str] | None = None) -> bytes:
    """The start of a safetensors file (its 8-byte length, then the JSON header padded to 8 bytes) for
    (name, tensor) pairs whose bytes follow in this order; for writers that stream the data themselves
    (the background writer, FSDP's export) instead of building the file in memory."""
    entries: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, t in tensors:
        size = t.numel() * t.element_size()
        entries[name] = {
            "dtype": SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    blob = json.dumps(entries, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return len(blob).to_bytes(8, "little") + blob


class CheckpointError(DdpkitError):
    """A checkpoint is incomplete, corrupted or not ddpkit's; the message names the file."""


# -- structure <-> JSON + tensors -------------------------------------------------------------------
def encode(obj: Any, tensors: dict[str, torch.Tensor], path: str) -> Any:
    """A JSON-compatible tree for `obj`; its tensors go into `tensors` under path-like keys."""
    if isinstance(obj, torch.Tensor):
        while path in tensors:  # keys such as 1 and "1" in one dict must not collide
            path += "'"
        tensors[path] = own_storage(obj.detach(), tensors)
        return {"__tensor__": path}
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": obj.tolist(), "dtype": str(obj.dtype)}
    if isinstance(obj, np.generic):
        return obj.item()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.dtype):
        return {"__dtype__": str(obj).removeprefix("torch.")}
    if isinstance(obj, tuple):
        return {"__tuple__": [encode(v, tensors, f"{path}/{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [encode(v, tensors, f"{path}/{i}") for i, v in enumerate(obj)]
    if isinstance(obj, Mapping):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: encode(v, tensors, f"{path}/{k}") for k, v in obj.items()}
        return {
            "__items__": [
                [encode(k, tensors, f"{path}/key{i}"), encode(v, tensors, f"{path}/{k}")]
                for i, (k, v) in enumerate(obj.items())
            ]
        }
    raise problem(
        f"cannot save {path} of type {type(obj).__name__}: ddpkit checkpoints hold only tensors, numbers, "
        "strings, lists, tuples and dicts (no pickle, so that loading can never run code)",
        "Convert it to one of those in the object's state_dict(), or leave it out of save()",
    )


class Tensors(dict):
    """The tensors of one file, by key; remembers their storages to avoid sharing memory."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: set[int] = set()


def own_storage(t: torch.Tensor, others: dict[str, torch.Tensor]) -> torch.Tensor:
    """safetensors refuses tensors that share memory (tied weights, views): copy those, and GPU tensors."""
    if t.device.type != "cpu" or not t.is_contiguous():
        return t.to("cpu", copy=True).contiguous()
    if not t.numel():
        return t
    seen = others.storages if isinstance(others, Tensors) else set()
    ptr = t.untyped_storage().data_ptr()
    if ptr in seen:
        return t.clone()
    seen.add(ptr)
    return t


def decode(tree: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """The inverse of `encode`."""
    if isinstance(tree, list):
        return [decode(v, tensors) for v in tree]
    if not isinstance(tree, dict):
        return tree
    if "__tensor__" in tree:
        return tensors[tree["__tensor__"]]
    if "__ndarray__" in tree:
        return np.array(tree["__ndarray__"], dtype=tree["dtype"])
    if "__dtype__" in tree:
        return getattr(torch, tree["__dtype__"])
    if "__tuple__" in tree:
        return tuple(decode(v, tensors) for v in tree["__tuple__"])
    if "__items__" in tree:
        return {_hashable(decode(k, tensors)): decode(v, tensors) for k, v in tree["__items__"]}
    return {k: decode(v, tensors) for k, v in tree.items()}


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key


# -- writing ------------------------------------------------------------------------------------------
def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Write a safetensors file, fsync it; return its size and SHA-256 for the manifest."""
    save_file(tensors, str(path), metadata={"format": FORMAT})
    return describe_file(path)


def write_json(path: Path, data: Any) -> dict[str, Any]:
    """Write JSON (NaN and infinities allowed, floats exact), fsync it; return size and SHA-256."""
    with open(path, "w") as f:
        json.dump(data, f, allow_nan=True)
    return describe_file(path)


def describe_file(path: Path) -> dict[str, Any]:
    """Fsync a written file; its size and SHA-256 for the manifest."""
    _fsync(path)
    return {"bytes": path.stat().st_size, "sha256": sha256_of(path)}


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    """The manifest goes last, with a checksum over its own content."""
    body = dict(manifest, format=FORMAT)
    body["self_sha256"] = hashlib.sha256(_canonical(body)).hexdigest()
    write_json(directory / MANIFEST, body)
    for sub in directory.iterdir():
        if sub.is_dir():
            _fsync(sub)
    _fsync(directory)


def _canonical(body: Mapping[str, Any]) -> bytes:
    return json.dumps({k: v for k, v in body.items() if k != "self_sha256"}, sort_keys=True).encode()


def commit(tmp: Path, final: Path) -> None:
    """Atomically publish a finished temporary directory under its final name."""
    os.rename(tmp, final)
    _fsync(final.parent)


def tmp_dir(root: Path, seq: int) -> Path:
    return root / f".ckpt-{seq:06d}.tmp"


def final_dir(root: Path, seq: int) -> Path:
    return root / f"ckpt-{seq:06d}"


# -- reading ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Found:
    """A checkpoint directory whose manifest and files all check out."""

    path: Path
    manifest: dict[str, Any]

    def file(self, name: str) -> Path:
        return self.path / name

    def read_json(self, name: str) -> Any:
        return json.loads(self._checked(name).read_text())

    def read_tensors(self, name: str) -> dict[str, torch.Tensor]:
        return load_file(str(self._checked(name)), device="cpu")

    def _checked(self, name: str) -> Path:
        """Re-check the one file this rank reads (another rank may have verified the rest)."""
        entry = self.manifest["files"].get(name)
        if entry is None:
            raise CheckpointError(f"{self.path} has no {name} in its manifest")
        check_file(self.path / name, entry)
        return self.path / name


def is_checkpoint(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def candidates(root: Path) -> list[Path]:
    """Checkpoint directories under `root`, newest (highest sequence number) first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found, reverse=True)]


def next_seq(root: Path) -> int:
    seqs = [int(m.group(1)) for p in root.iterdir() if (m := _NAME.match(p.name) or _TMP.match(p.name))]
    return max(seqs, default=0) + 1


def verify(path: Path) -> Found:
    """Check the manifest and every file it lists; raise `CheckpointError` naming what is wrong."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{path} has no {MANIFEST}: it is incomplete or not a ddpkit checkpoint")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{manifest_path} is not valid JSON ({err}): the file is damaged") from None
    verify_manifest(path, manifest)
    for name, entry in manifest["files"].items():
        try:
            check_file(path / name, entry)
        except CheckpointError as err:
            if shard_rank(name) is None:
                raise
            raise shard_refused(path, manifest, name, err) from None
        _check_format(path / name)
    return Found(path, manifest)


def shard_rank(name: str) -> int | None:
    """The rank whose shards a checkpoint file holds (`dcp/__<rank>_0.distcp`), or None."""
    m = _SHARD.match(name)
    return int(m.group(1)) if m else None


def shard_refused(
    path: Path, manifest: Mapping[str, Any], name: str, err: CheckpointError
) -> CheckpointError:
    """The refusal of a checkpoint whose shard file does not match the digest its rank recorded at the
    save: which rank's, why nothing of the checkpoint loads, and what to do."""
    rank, entry = shard_rank(name), manifest["files"][name]
    step = manifest.get("step")
    at = f" at step {step}" if step is not None else ""
    return CheckpointError(
        f"{str(err).rstrip('.')}: it holds the model and optimizer shards that rank {rank} of "
        f"{manifest.get('world_size', '?')} wrote{at}, without which the other ranks' shards cannot "
        f"be loaded, so no rank loads {path.name}. A load of the folder {path.parent} resumes from the "
        f"checkpoint before it by itself; to use this one, restore {path.name}/{name} from a backup (its "
        f"SHA-256 at the save: {entry['sha256'][:16]}...), and if it recurs, check the disk or the copy "
        f"that holds rank {rank}'s files"
    )


def verify_manifest(path: Path, manifest: Any) -> None:
    """The manifest itself: ddpkit's format, its own checksum, only file names ddpkit writes."""
    manifest_path = path / MANIFEST
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{manifest_path} is not a {FORMAT} manifest")
    if hashlib.sha256(_canonical(manifest)).hexdigest() != manifest.get("self_sha256"):
        raise CheckpointError(f"{manifest_path} does not match its own checksum: the file is damaged")
    for name in manifest["files"]:
        if not _SAFE_NAME.match(name):
            raise CheckpointError(f"{manifest_path} lists a file named {name!r}: not a ddpkit checkpoint")


def _check_format(path: Path) -> None:
    """Parse what is cheap to parse, so a well-hashed file of the wrong kind is refused up front."""
    if path.suffix == ".json":
        try:
            json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError):
            raise CheckpointError(f"{path} is not JSON: not a ddpkit checkpoint file") from None
    elif path.suffix == ".safetensors":
        with open(path, "rb") as f:
            head = f.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else -1
            ok = 0 < length <= path.stat().st_size - 8
            try:
                ok = ok and isinstance(json.loads(f.read(length)), dict)
            except (ValueError, UnicodeDecodeError):
                ok = False
        if not ok:
            raise CheckpointError(f"{path} is not a safetensors file (a pickle?): refused unread")


def check_file(path: Path, entry: Mapping[str, Any]) -> None:
    if not path.is_file():
        raise CheckpointError(f"{path} is missing")
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise CheckpointError(f"{path} has {size} bytes, the manifest says {entry['bytes']} (truncated?)")
    if sha256_of(path) != entry["sha256"]:
        raise CheckpointError(f"{path} does not match its SHA-256 in the manifest: the file is corrupted")


def foreign(root: Path) -> str | None:
    """What `root` holds when it exists but is not a folder of ddpkit checkpoints (None when it is one,
    is empty, or does not exist yet): a file written by another tool, or a folder of unrelated files.

    Why ask: "no checkpoint yet" on such a path starts a whole run fresh and then fails at the first
    save (a file cannot become a folder), or silently ignores the snapshot the user meant to resume."""
    if not root.exists() and not root.is_symlink():
        return None
    if not root.is_dir():
        size = human_size(root.stat().st_size)
        return f"{root} is a file ({size}, {_kind(root)}), not a folder of checkpoints"
    entries = sorted(root.iterdir())
    if not entries or any(_NAME.match(p.name) or _TMP.match(p.name) for p in entries):
        return None
    shown = ", ".join(p.name + ("/" if p.is_dir() else "") for p in entries[:5])
    more = f" and {len(entries) - 5} more" if len(entries) > 5 else ""
    return (
        f"{root} is a folder of {len(entries)} other entries ({shown}{more}) and no ddpkit checkpoint "
        "(ckpt-NNNNNN/ folders)"
    )


def human_size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{int(n)} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)  # not reached


def _kind(path: Path) -> str:
    """A guess at a file's format from its first bytes, for the refusal's wording."""
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except OSError:
        return "unreadable"
    if head.startswith(b"PK\x03\x04"):
        return "a zip archive, the format torch.save writes"
    if head[:1] == b"\x80":
        return "a pickle"
    if len(head) == 16 and head[8:9] == b"{":
        return "a safetensors file"
    return "not a ddpkit checkpoint"


def newest_valid(root: Path) -> tuple[Found | None, list[str]]:
    """The newest checkpoint that verifies, and one line per newer one that did not."""
    skipped: list[str] = []
    for path in candidates(root):
        try:
            return verify(path), skipped
        except CheckpointError as err:
            skipped.append(str(err))
    return None, skipped


def unfinished_after(root: Path, newest: Path) -> list[Path]:
    """Temporary directories newer than the checkpoint `newest`: saves that never finished."""
    m = _NAME.match(newest.name)
    if m is None or not root.is_dir():
        return []
    return sorted(
        p for p in root.iterdir() if (t := _TMP.match(p.name)) and int(t.group(1)) > int(m.group(1))
    )


def tmp_seq(path: Path) -> int | None:
    """The sequence number of a temporary checkpoint directory (a save being written, or left by a
    crash), None for anything else."""
    m = _TMP.match(path.name)
    return int(m.group(1)) if m else None
