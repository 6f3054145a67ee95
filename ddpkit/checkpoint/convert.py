"""`ddpkit checkpoint convert`: a checkpoint out to the formats other tools read, and back.

    to_safetensors("runs/ckpt", "model.safetensors")           # one file, plain safetensors
    to_hf("runs/ckpt", "gpt2-out", config="runs/export")      # a folder `from_pretrained` loads
    to_torch("runs/ckpt", "model.pt")                         # a `torch.save` state dict
    from_weights("gpt2-out", "runs/ckpt")                     # back: a checkpoint `s.load` resumes

From a checkpoint written by DDP or one process (a whole-model file) or by FSDP at any world size
(DCP shards), offline: no process group, no torch.distributed set up. The checkpoint is verified first
(every checksum; one that fails is refused, never converted). The safetensors and Hugging Face routes
hold one tensor at a time (`ddpkit.checkpoint.reading`): the header is written from the shapes known up
front, then each tensor's bytes as it is read. `torch.save` needs its whole dict in memory, so that
route holds the model. Every output is written under a temporary name and renamed into place.

Back: the weights of a safetensors file or a `save_pretrained` folder become a checkpoint of one
model (`--name`, default "model") at world size 1, which `s.load(root, model=model)` resumes under any
strategy (FSDP reshards it). It holds no RNG streams (the session's seeded ones are kept), no optimizer
and no loader: a start from those weights, as from a pretrained model.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from ddpkit.checkpoint import files, reading
from ddpkit.checkpoint import state as checkpoint_state
from ddpkit.checkpoint.files import CheckpointError, Tensors
from ddpkit.checkpoint.reading import TensorInfo

CONFIG_FILES = ("config.json", "generation_config.json")


def to_safetensors(source: str | Path, out: str | Path, *, model: str | None = None) -> tuple[Path, int]:
    """The checkpoint's model (`model`: its keyword in s.save) as one safetensors file; (path, tensors)."""
    found = reading.open_checked(source)
    name = reading.pick_model(found, model)
    infos = reading.weight_infos(found, name)
    return _stream(Path(out), infos, reading.weights(found, name)), len(infos)


def to_hf(
    source: str | Path, out: str | Path, *, config: str | Path, model: str | None = None
) -> tuple[Path, int]:
    """A Hugging Face folder: `model.safetensors` plus the config (`config.json`, and
    `generation_config.json` when there is one) from `config`: the folder `s.export` wrote for the same
    model, or a config.json file."""
    found = reading.open_checked(source)  # a checksum that fails first: nothing else matters then
    configs = _configs(Path(config))
    target = Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise CheckpointError(
            f"{target} exists and is not an empty folder. Pass a new folder for the Hugging Face model "
            "(nothing is overwritten)"
        )
    name = reading.pick_model(found, model)
    infos = reading.weight_infos(found, name)
    target.mkdir(parents=True, exist_ok=True)
    _stream(target / "model.safetensors", infos, reading.weights(found, name))
    for path in configs:
        shutil.copyfile(path, target / path.name)
    return target, len(infos)


def to_torch(source: str | Path, out: str | Path, *, model: str | None = None) -> tuple[Path, int]:
    """A plain `torch.save` state dict (`torch.load(out, weights_only=True)` reads it)."""
    found = reading.open_checked(source)
    name = reading.pick_model(found, model)
    state = dict(reading.weights(found, name))
    target = Path(out)
    partial = _partial(target)
    torch.save(state, partial)
    partial.replace(target)
    return target, len(state)


def from_weights(
    source: str | Path, root: str | Path, *, name: str = "model", step: int | None = None
) -> Path:
    """A safetensors file or a `save_pretrained` folder into a new checkpoint under `root` (atomic, with
    its manifest, as `s.save` writes one); the checkpoint's directory."""
    paths = weight_files(Path(source))
    root = Path(root)
    if (what := files.foreign(root)) is not None:
        raise CheckpointError(f"{what}. Pass a new or empty folder, or one s.save wrote into")
    root.mkdir(parents=True, exist_ok=True)
    seq = files.next_seq(root)
    tmp, final = files.tmp_dir(root, seq), files.final_dir(root, seq)
    tmp.mkdir()
    try:
        infos = [i for p in paths for i in reading.safetensors_entries(p)[0]]
        chained = (kv for p in paths for kv in reading.read_safetensors(p))
        entries = {
            f"{name}.safetensors": _write_stream(
                tmp / f"{name}.safetensors", infos, chained, {"format": files.FORMAT}
            )
        }
        entries["state.safetensors"] = files.write_tensors(tmp / "state.safetensors", Tensors())
        values = {"step": step} if step is not None else {}
        entries["state.json"] = files.write_json(tmp / "state.json", {"objects": {}, "values": values})
        entries.update(checkpoint_state.write_rank(tmp, 0, {"rng": None, "objects": {}}, Tensors()))
        files.write_manifest(
            tmp,
            {
                "seq": seq,
                "created": time.time(),
                "torch": torch.__version__,
                "world_size": 1,
                "step": step,
                "strategy": "single",
                "converted_from": str(source),
                "files": entries,
                "objects": {"modules": [name], "per_rank": [], "shared": [], "values": sorted(values)},
            },
        )
        files.commit(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def weight_files(source: Path) -> list[Path]:
    """The safetensors files of a file or a `save_pretrained` folder (one, or the index's shards)."""
    if source.is_file() and source.suffix == ".safetensors":
        return [source]
    if source.is_dir():
        if (source / "model.safetensors").is_file():
            return [source / "model.safetensors"]
        index = source / "model.safetensors.index.json"
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return [source / s for s in shards]
    raise CheckpointError(
        f"{source} is neither a safetensors file nor a folder that save_pretrained wrote (model.safetensors, "
        "or model.safetensors.index.json and its shards). Pass one of those (pytorch_model.bin is not read: "
        "it is a pickle)"
    )


def _configs(config: Path) -> list[Path]:
    if config.is_file() and config.name.endswith(".json"):
        return [config]
    found = [config / n for n in CONFIG_FILES if (config / n).is_file()]
    if not found or found[0].name != "config.json":
        raise CheckpointError(
            f"{config} has no config.json. Pass --config the folder s.export wrote for this model (an HF "
            "model exported to a folder gets its config.json there) or a config.json file"
        )
    return found


def _partial(target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    return target.with_name(f".{target.name}.tmp")


def _stream(target: Path, infos: list[TensorInfo], tensors: Iterable[tuple[str, torch.Tensor]]) -> Path:
    partial = _partial(target)
    try:
        _write_stream(partial, infos, tensors, {"format": "pt"})  # "pt": what transformers expects
        partial.replace(target)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return target


def _write_stream(
    path: Path, infos: list[TensorInfo], tensors: Iterable[tuple[str, torch.Tensor]], metadata: dict[str, str]
) -> dict[str, Any]:
    """A safetensors file from tensors that arrive one at a time, in the order of `infos` (whose shapes
    and dtypes make the header); fsynced; its size and SHA-256 for a manifest."""
    placeholders = [(i.key, torch.empty(i.shape, dtype=i.dtype, device="meta")) for i in infos]
    head = files.safetensors_header(placeholders, metadata)
    with open(path, "wb", buffering=0) as f:
        f.write(head)
        for info, (key, tensor) in zip(infos, tensors, strict=True):
            if key != info.key or tuple(tensor.shape) != info.shape or tensor.dtype != info.dtype:
                raise CheckpointError(
                    f"{key} {list(tensor.shape)} {tensor.dtype} read where the header "
                    f"says {info.key} {list(info.shape)} {info.dtype}"
                )
            if tensor.numel():
                data = memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
                while data:
                    data = data[f.write(data) :]
        os.fsync(f.fileno())
    return files.describe_file(path)
