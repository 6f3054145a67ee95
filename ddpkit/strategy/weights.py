"""Pretrained weights into a model as the strategy holds it: `s.model(Net, weights=path)`.

    model = s.model(lambda: AutoModelForCausalLM.from_config(cfg), strategy="fsdp", weights="ckpt/")

`path`: one safetensors file, or a directory as `save_pretrained` writes it (`model.safetensors`, or
`model.safetensors.index.json` and its shards). Why not `Model.from_pretrained` on every rank: every rank
would then read and hold the whole model (the CPU-memory blow-ups of ms-swift#9982, AReaL#1182,
verl#4644), which is what FSDP exists to avoid.

- FSDP: after `fully_shard`, each rank reads only its own rows of each parameter, the dim-0 chunk its
  DTensor holds, with `safe_open(...).get_slice(name)[start:stop]` (the file is memory-mapped; only those
  rows' pages are touched). No rank holds the full model, not even one full tensor.
- DDP: global rank 0 reads the file into its module before DDP wraps it; DDP's constructor broadcasts
  rank 0's weights to the others anyway (one read, no extra collective). One process: read as is.

Names: a parameter may be found under any of its names (a tied head is saved once, under either name:
`save_pretrained` drops `lm_head.weight`). A transformers model's file is read under the names
`from_pretrained` would give its keys (`hf_names`): transformers' own conversion mapping, which
`save_pretrained` reverses when it writes (a ViT's file holds `vit.encoder.layer.0.attention.attention.query`
for the model's `vit.layers.0.attention.q_proj`), and the base model's prefix added or dropped (the bare
`GPT2Model`'s file loads into `GPT2LMHeadModel`). A parameter or buffer the file lacks, or a shape that
differs, is a clear error naming it and the file's names.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddpkit.errors import problem
from ddpkit.parallel.modules import unwrap
from ddpkit.strategy import adapters
from ddpkit.strategy.checkpointing import plain_name

Weights = str | os.PathLike | None


@dataclass
class Source:
    """Where each tensor of a checkpoint lives: name -> file."""

    where: dict[str, Path] = field(default_factory=dict)
    renamed: dict[str, str] = field(default_factory=dict)  # a model's name -> the file's key (`hf_names`)
    converted: list[str] = field(default_factory=list)  # keys transformers converts, not renames

    @classmethod
    def open(cls, path: str | os.PathLike) -> Source:
        root = Path(path)
        if root.is_dir():
            index = root / "model.safetensors.index.json"
            if index.is_file():
                weight_map = json.loads(index.read_text())["weight_map"]
                return cls({k: root / f for k, f in weight_map.items()})
            root = root / "model.safetensors"
        if not root.is_file() or root.suffix != ".safetensors":
            raise problem(
                f"weights={str(path)!r} is neither a .safetensors file nor a directory holding "
                "model.safetensors or model.safetensors.index.json",
                "Pass the file, or the directory save_pretrained wrote (pytorch_model.bin is not read: "
                "convert it to safetensors)",
            )
        from safetensors import safe_open

        with safe_open(str(root), framework="pt") as f:
            return cls(dict.fromkeys(f.keys(), root))

    def name_for(self, names: list[str]) -> str | None:
        """The file's key holding the tensor of these names: one of them, else one renamed to them."""
        return next((n for n in names if n in self.where), None) or next(
            (self.renamed[n] for n in names if n in self.renamed), None
        )

    def for_model(self, module: nn.Module, names: set[str]) -> Source:
        """This source with the names transformers gives its keys when `module` is its model."""
        renamed, converted = hf_names(module, list(self.where), names)
        return Source(self.where, {new: key for key, new in renamed.items() if new != key}, converted)


def hf_names(module: nn.Module, keys: list[str], names: set[str]) -> tuple[dict[str, str], list[str]]:
    """For a transformers model: the name `from_pretrained` loads each file key into (its conversion
    mapping, then the base model's prefix added or dropped against the model's `names`), and the keys
    it would convert (split, merge, transpose: `WeightConverter`) rather than rename, which are not the
    file's rows. ({}, []) for any other model, and without importing transformers."""
    tf = sys.modules.get("transformers")
    if tf is None or not isinstance(module, tf.PreTrainedModel):
        return {}, []
    known = dict.fromkeys(names, True)
    prefix = getattr(module, "base_model_prefix", "") or None
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        with _own_classes(module):
            transforms = get_model_conversion_mapping(module)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        out: dict[str, str] = {}
        converted = []
        for key in keys:
            new, pattern = rename_source_key(key, renamings, converters, prefix, known)
            if pattern is not None:
                converted.append(key)
            else:
                out[key] = new
        return out, converted
    except (ImportError, TypeError):  # a transformers without this mapping: the prefix only
        if prefix is None:
            return {}, []
        return {k: _with_prefix(k, prefix, names) for k in keys}, []


@contextmanager
def _own_classes(module: nn.Module) -> Iterator[None]:
    """The model's modules under their own classes while transformers looks its mapping up by class name:
    `fully_shard` gives each unit a class of its own (`FSDPViTModel`), which no mapping names."""
    from torch.distributed.fsdp import FSDPModule

    swapped: list[tuple[nn.Module, type]] = []
    for sub in module.modules():
        sharded = type(sub)
        if isinstance(sub, FSDPModule) and FSDPModule in sharded.__bases__:
            swapped.append((sub, sharded))
            sub.__class__ = next(b for b in sharded.__bases__ if b is not FSDPModule)
    try:
        yield
    finally:
        for sub, sharded in swapped:
            sub.__class__ = sharded


def _with_prefix(key: str, prefix: str, names: set[str]) -> str:
    """The key with the base model's prefix added or dropped, where that makes it one of `names`."""
    if key.startswith(f"{prefix}.") and key[len(prefix) + 1 :] in names:
        return key[len(prefix) + 1 :]
    return f"{prefix}.{key}" if f"{prefix}.{key}" in names else key


def _aliases(module: nn.Module) -> dict[str, list[str]]:
    """Each parameter's and buffer's first name -> all its names (tied weights have several)."""
    by_id: dict[int, list[str]] = {}
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    for name, t in named:
        by_id.setdefault(id(t), []).append(name)
    by_id = {k: [*v, *(plain_name(n) for n in v if plain_name(n) != n)] for k, v in by_id.items()}
    if adapters.is_peft(module):  # a PEFT model: the base's names (`weights=` is the base's checkpoint)
        by_id = {k: [*v, *(adapters.base_name(n) for n in v)] for k, v in by_id.items()}
    return {names[0]: names for names in by_id.values()}


def _plan(module: nn.Module, source: Source) -> dict[str, str]:
    """Module name -> file name, for every parameter and persistent buffer; a clear error if any lacks."""
    persistent = set(module.state_dict().keys())  # checkpoint wrappers' segment stripped, as in files
    source = source.for_model(module, persistent)
    plan, missing = {}, []
    for first, names in _aliases(module).items():
        if not any(n in persistent for n in names):
            continue  # a non-persistent buffer (e.g. rotary inv_freq): computed, never saved
        if adapters.is_peft(module) and adapters.added_by_peft(module, first):
            continue  # an adapter (LoRA's A, B): not in the base's checkpoint; keeps its initial values
        found = source.name_for(names)
        if found is None:
            missing.append(first)
        else:
            plan[first] = found
    if missing:
        shown = ", ".join(missing[:6]) + (", ..." if len(missing) > 6 else "")
        some = ", ".join(sorted(source.where)[:3])
        converted = (
            f"; transformers converts {len(source.converted)} of its keys "
            f"({', '.join(source.converted[:3])}) "
            "rather than renaming them, which a rank cannot read by rows"
            if source.converted
            else ""
        )
        raise problem(
            f"the weights lack {len(missing)} of the {type(module).__name__}'s tensors ({shown}); the file's "
            f"names start {some}{converted}",
            "Pass a checkpoint of this model class (save_pretrained of the same architecture), or load it "
            "with from_pretrained and pass that model to s.model",
        )
    return plan


def _tensors(source: Source, plan: dict[str, str]) -> Iterator[tuple[str, str, Any]]:
    """(module name, file name, safetensors slice) for each planned tensor, each file opened once."""
    from safetensors import safe_open

    with ExitStack() as stack:
        files: dict[Path, Any] = {}
        for name, key in plan.items():
            path = source.where[key]
            if path not in files:
                files[path] = stack.enter_context(safe_open(str(path), framework="pt"))
            yield name, key, files[path].get_slice(key)


def _check_shape(name: str, key: str, got: list[int], want: torch.Size) -> None:
    if list(got) != list(want):
        raise problem(
            f"the weights' {key!r} has shape {list(got)}, the model's {name!r} {list(want)}",
            "Pass a checkpoint of the same configuration (sizes, vocabulary) as the model",
        )


@torch.no_grad()
def load_whole(module: nn.Module, path: str | os.PathLike) -> int:
    """Read every tensor of the checkpoint into the (whole, unwrapped) module; the number read."""
    source = Source.open(path)
    plan = _plan(module, source)
    for name, key, part in _tensors(source, plan):
        target = module.get_parameter(name) if _is_param(module, name) else module.get_buffer(name)
        _check_shape(name, key, part.get_shape(), target.shape)
        target.copy_(part[:])
    return len(plan)


@torch.no_grad()
def load_rows(model: nn.Module, path: str | os.PathLike) -> int:
    """FSDP: each rank reads only the rows its shard of each parameter holds; buffers (whole under
    FSDP2, small) are read whole. The number of tensors read."""
    module = unwrap(model)
    source = Source.open(path)
    plan = _plan(module, source)
    for name, key, part in _tensors(source, plan):
        is_param = _is_param(module, name)
        target = module.get_parameter(name) if is_param else module.get_buffer(name)
        _check_shape(name, key, part.get_shape(), target.shape)
        if not hasattr(target, "to_local"):
            target.copy_(part[:])
            continue
        local = target.to_local()
        start, stop = _rows(target)
        if stop > start:
            local.copy_(part[start:stop].reshape(local.shape))
    return len(plan)


def _is_param(module: nn.Module, name: str) -> bool:
    try:
        module.get_parameter(name)
        return True
    except AttributeError:
        return False


def _rows(param: Any) -> tuple[int, int]:
    """The global rows [start, stop) of a DTensor sharded on dim 0 (torch.chunk, as fully_shard cuts)
    over one mesh dimension, replicated over any other (HSDP's (Replicate, Shard(0)): the rows follow
    this rank's place on the shard dimension, not its global rank)."""
    from torch.distributed.tensor import Replicate, Shard

    placements = param.placements
    sharded = [i for i, p in enumerate(placements) if isinstance(p, Shard) and p.dim == 0]
    others = [p for i, p in enumerate(placements) if i not in sharded]
    if len(sharded) != 1 or not all(isinstance(p, Replicate) for p in others):
        raise problem(
            f"a parameter is sharded as {placements}, not by rows over one mesh dimension",
            "Load weights into an FSDP model that ddpkit sharded (s.model(..., weights=))",
        )
    dim = sharded[0]
    rank, world = param.device_mesh.get_local_rank(dim), param.device_mesh.size(dim)
    rows = param.shape[0]
    size = -(-rows // world)  # torch.chunk's chunk size
    start = min(rank * size, rows)
    return start, min(start + size, rows)
