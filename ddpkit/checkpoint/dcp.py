"""The sharded part of a checkpoint: model and optimizer shards through torch.distributed.checkpoint.

    ckpt-000004/
      dcp/.metadata            written by global rank 0: which rank's file holds which piece of what
      dcp/__0_0.distcp         global rank 0's shards (each rank writes its own file)
      dcp/__1_0.distcp
      state.json, rank-*.json, manifest.json ...   as for any checkpoint (`ddpkit.checkpoint.files`)

Used under a strategy whose state lives in shards (FSDP, HSDP). Each rank writes only its shards, and any
world size and mesh reads them back: DCP maps saved pieces onto the new shards (resharding; HSDP's
replicas are written once, by the first replica that holds each piece). The files sit in
the temporary directory of the checkpoint until it is renamed into place, and the manifest holds their
sizes and SHA-256, so atomicity, checksums and keep-last-K are those of every ddpkit checkpoint.

No pickle runs on load: DCP writes `.metadata` with pickle, so ddpkit reads it with an unpickler that
builds only DCP's own metadata classes and torch's sizes and dtypes (anything else is refused unread);
DCP reads the tensors themselves as raw bytes, and small objects with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import io
import pickle
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ddpkit.checkpoint.files import CheckpointError, Found, describe_file
from ddpkit.checkpoint.owners import StateOwner
from ddpkit.errors import problem

DIRECTORY = "dcp"
NAME = re.compile(r"^dcp/(\.metadata|__\d+_\d+\.distcp)$")


def save(state: dict, tmp: Path, rank: int, group: Any = None, process: Any = None) -> dict[str, Any]:
    """Write this rank's shards of `state` (a collective over `group`, default: the default group); the
    manifest entries of the files it wrote. A background save calls it on ddpkit's writer thread with a
    gloo group of the checkpoints' own, so DCP's collectives never mix with training's. With `process`
    (`background="process"`: a `WriterProcess`) DCP plans on this thread, and the writer process writes
    and hashes the rank's file: its bytes never pass through training's interpreter. Without, this
    thread writes it the same way (`writer_child.write_items`): hashed as it is written, not read back."""
    write = process.write_shards if process is not None else write_here
    writer = hashing_writer(tmp / DIRECTORY, write)
    _dcp_save(state, writer, group)
    listed = dict(writer.entries)
    if rank == 0:
        listed[f"{DIRECTORY}/.metadata"] = describe_file(tmp / DIRECTORY / ".metadata")
    return listed


def write_here(path: Path, items: list[torch.Tensor | io.BytesIO]) -> dict[str, Any]:
    """One rank's DCP file written and hashed on the calling thread (`writer_child.write_items`)."""
    from ddpkit.checkpoint.writer_child import write_items

    return write_items(str(path), [i.getbuffer() if isinstance(i, io.BytesIO) else exact(i) for i in items])


def exact(t: torch.Tensor) -> torch.Tensor:
    """`t` on the CPU in a storage of exactly its bytes (`torch.save` writes a tensor's whole storage):
    itself when it owns them, else a tensor over the same memory (a copy in a reused staging segment,
    `ddpkit.checkpoint.staging`), else a clone (what DCP's own writer does)."""
    t = t.detach().cpu()
    n = t.numel() * t.element_size()
    if t.untyped_storage().nbytes() == n:
        return t
    if n and t.is_contiguous():
        try:  # the same bytes, no copy: numpy's view of them carries no more than they are
            flat = torch.from_numpy(t.reshape(-1).view(torch.uint8).numpy())
            return flat.view(t.dtype).view(t.shape)
        except (RuntimeError, TypeError):
            pass
    return t.clone()


def _dcp_save(state: dict, writer: Any, group: Any) -> None:
    """DCP's save; its failure on any rank (raised on every rank as DCP's `CheckpointException`, a
    BaseException that `except Exception` would let through) as a `CheckpointError` naming each rank's."""
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp_save(state, storage_writer=writer, process_group=group)
    except CheckpointException as err:
        ranks = "; ".join(
            f"rank {r}: {type(e).__name__}: {str(e).split(chr(10))[0]}"
            for r, (e, _) in sorted(err.failures.items())
        )
        raise CheckpointError(
            f"the sharded state (DCP) could not be saved ({ranks}): this save is not committed, and the "
            "previous checkpoint is untouched and still the newest valid one"
        ) from err


def hashing_writer(directory: Path, write: Any) -> Any:
    """DCP's `FileSystemWriter` whose `write_data` (the bytes: every tensor's `torch.save`, then fsync) is
    `write(path, items)`: the writer process's `write_shards`, or `write_here` on the calling thread;
    both hash the file as they write it. Planning, the collectives and the metadata stay DCP's own, on
    the calling thread. The file is the one DCP would write (`__<rank>_0.distcp`, one per rank, the
    same items in the same format), so DCP's reader, resharding, inspect and convert read it
    unchanged; `entries` holds its manifest entry (size, SHA-256)."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future

    class HashingWriter(FileSystemWriter):
        def __init__(self) -> None:
            super().__init__(directory, single_file_per_rank=True, thread_count=1)
            self.entries: dict[str, Any] = {}

        def write_data(self, plan: Any, planner: Any) -> Future:
            name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"  # FileSystemWriter's: one file per rank
            byte_items = [w for w in plan.items if w.type == WriteItemType.BYTE_IO]  # first, as DCP does
            items = byte_items + [w for w in plan.items if w.type != WriteItemType.BYTE_IO]
            answer = write(directory / name, [planner.resolve_data(w) for w in items])
            results = [
                WriteResult(index=w.index, size_in_bytes=n, storage_data=_StorageInfo(name, offset, n))
                for w, (offset, n) in zip(items, answer["spans"], strict=True)
            ]
            self.entries[f"{DIRECTORY}/{name}"] = {"bytes": answer["bytes"], "sha256": answer["sha256"]}
            done: Future = Future()
            done.set_result(results)
            return done

    return HashingWriter()


def stage(state: Any, into: Any = None) -> Any:
    """A copy of every tensor of `state` (a DTensor stays a DTensor: this rank's shard is copied), so
    that training may change the originals while the writer saves the copy. `into`: a function that
    copies a tensor where the writer process reads it (`Arena.stage`); default a clone.

    Not DCP's `async_save`: measured on 2 CPU ranks (37.8M MLP, FSDP), its own thread cost 106-148 %
    of a synchronous save's training time; this copy plus ddpkit's idle-priority writer, 77-78 %."""
    if isinstance(state, torch.Tensor):
        if into is None:
            return state.detach().clone()
        from torch.distributed.tensor import DTensor

        if isinstance(state, DTensor):
            local = into(state.to_local().detach())
            return DTensor.from_local(
                local,
                state.device_mesh,
                state.placements,
                run_check=False,
                shape=state.shape,
                stride=state.stride(),
            )
        return into(state.detach())
    if isinstance(state, dict):
        return {k: stage(v, into) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(stage(v, into) for v in state)
    return state


def load(state: dict, checkpoint: Path) -> None:
    """Fill `state` (this rank's shards, as `Strategy.sharded_state` builds them) in place; a collective."""
    from torch.distributed.checkpoint import load as dcp_load

    directory = _checked_metadata(checkpoint)
    dcp_load(state, storage_reader=safe_reader(directory))


def saved_keys(checkpoint: Path) -> set[str]:
    """The flattened names (`model.<key>`, `<optimizer>.state.<key>...`) of what the checkpoint's shards
    hold, from its metadata (read by `MetadataUnpickler`)."""
    return set(safe_reader(_checked_metadata(checkpoint)).read_metadata().state_dict_metadata)


def _checked_metadata(checkpoint: Path) -> Path:
    """The checkpoint's DCP directory, its metadata read by `MetadataUnpickler` first (refused otherwise)."""
    directory = checkpoint / DIRECTORY
    if not (directory / ".metadata").is_file():
        raise CheckpointError(
            f"{checkpoint} has no sharded state ({DIRECTORY}/.metadata): it was saved "
            "without FSDP; load it with the strategy it was saved with"
        )
    try:  # refused here, on every rank alike, before DCP's collectives wrap it in every rank's traceback
        MetadataUnpickler(io.BytesIO((directory / ".metadata").read_bytes())).load()
    except (CheckpointError, pickle.UnpicklingError, EOFError, ValueError) as err:
        raise CheckpointError(
            f"refused to load {checkpoint}: {str(err).rstrip('.')}. Nothing of it was run or loaded. Its "
            "manifest's checksums match it, so it was replaced after the save, checksums included. Move "
            f"{checkpoint.name} out of {checkpoint.parent} (or delete it) to resume from the checkpoint "
            "before it, or restore it from a backup you trust"
        ) from None
    return directory


def _reader_class() -> type:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            path = Path(self.path) / ".metadata"
            metadata = MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader


def safe_reader(directory: Path) -> Any:
    """DCP's file reader with the metadata read by `MetadataUnpickler` (no other pickle runs)."""
    return _reader_class()(directory)


_ALLOWED_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner")
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # layouts are pickled as this lookup by name
    ("pathlib", "PosixPath"),  # the checkpoint's own path, recorded by the writer
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
}


class MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata dataclasses, torch sizes, dtypes, layouts and memory formats; nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        import importlib

        if (module, name) in _ALLOWED or module in _ALLOWED_MODULES:
            obj = getattr(importlib.import_module(module), name)
            if isinstance(obj, type) or (module, name) in _ALLOWED:
                return obj
        if module == "torch":
            obj = getattr(torch, name, None)
            if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
                return obj
        raise CheckpointError(
            f"the sharded checkpoint's metadata names {module}.{name}, which is not DCP "
            "metadata: refused unread (a planted pickle?)"
        )


def pair_optimizers(model: Any, optimizers: Mapping[str, torch.optim.Optimizer]) -> dict[str, Any]:
    """The optimizers whose parameters belong to `model` (their state is sharded with it)."""
    own = {id(p) for p in model.parameters()}
    return {
        n: o for n, o in optimizers.items() if any(id(p) in own for g in o.param_groups for p in g["params"])
    }


def split(strategy: StateOwner, parts: dict[str, dict[str, Any]]) -> tuple[tuple[str, Any], dict] | None:
    """Under a strategy that shards state (FSDP): take its model and that model's optimizers out of
    `parts`; they go through torch.distributed.checkpoint. None otherwise."""
    if not strategy.shards_state:
        return None
    models = [(n, m) for n, m in parts["modules"].items() if strategy.owns(m)]
    if not models:
        return None
    if len(models) > 1:
        raise problem(
            f"{len(models)} sharded models were passed ({', '.join(n for n, _ in models)})",
            "Save one FSDP model per checkpoint (wrap the others into one nn.Module)",
        )
    name, model = models[0]
    optimizers = {n: o for n, o in parts["shared"].items() if isinstance(o, torch.optim.Optimizer)}
    paired = pair_optimizers(model, optimizers)
    for n in paired:
        del parts["shared"][n]
    del parts["modules"][name]
    return (name, model), paired


def assemble(strategy: StateOwner, sharded: tuple[tuple[str, Any], dict]) -> dict[str, Any]:
    """The state DCP saves and loads for `split`'s (name, model), optimizers: the model's under its name,
    each optimizer's under its own (the strategy's `sharded_state`, one place for saves and loads)."""
    (name, model), optimizers = sharded
    state_dicts = strategy.sharded_state(model, optimizers)
    return {name: state_dicts.pop("model"), **state_dicts}


def load_into(
    strategy: StateOwner, found: Found, sharded: tuple[tuple[str, Any], dict], *, strict: bool
) -> None:
    """Model and optimizer shards through DCP, at any world size and mesh; or full weights saved
    without shards (DDP, one process).

    Shards saved on one mesh load onto another: DCP's metadata records each saved piece's offsets in
    the full tensor (HSDP's replicas are written once), and the load reads, for this rank's DTensors,
    whichever pieces overlap them. So an HSDP (2 x 2) checkpoint resumes under FSDP over 4 or 2 ranks,
    HSDP (1 x 2), and the other way round. An optimizer saved whole (DDP, one process) is cut into
    this rank's shards (`load_whole_optimizers`)."""
    (name, model), optimizers = sharded
    saved = found.manifest.get("strategy", "ddp")
    if not found.manifest.get("objects", {}).get("sharded"):  # saved by DDP or one process: whole state
        strategy.load_full_state(model, found.read_tensors(f"{name}.safetensors"), strict=strict)
        if optimizers:
            load_whole_optimizers(model, optimizers, found, strict=strict)
        return
    strategy.check_loadable(saved, list(optimizers), found.path)  # the rule lives with the strategy
    state = assemble(strategy, sharded)
    load(state, found.path)
    strategy.load_sharded_state(model, optimizers, {"model": state.pop(name), **state})


def load_whole_optimizers(
    model: Any, optimizers: Mapping[str, torch.optim.Optimizer], found: Found, *, strict: bool
) -> None:
    """Optimizer states saved whole (by DDP or one process: `state.json`, keyed by parameter index) into
    the sharded model's optimizers: keyed by parameter name (the i-th parameter of the optimizer's groups
    now, which a script that builds its optimizer the same way has in the same order as when it saved),
    then cut into this rank's shards by torch's `set_optimizer_state_dict(full_state_dict=True)`. Every
    rank reads the whole state once (a CPU copy of it, for the time of the load); values are copied."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    from ddpkit.checkpoint.files import decode

    shared, tensors = found.read_json("state.json"), found.read_tensors("state.safetensors")
    names = {id(p): n for n, p in model.named_parameters()}
    for key, opt in optimizers.items():
        whole = decode(shared["objects"][key], tensors)
        order = [names[id(p)] for g in opt.param_groups for p in g["params"]]
        saved = [int(i) for g in whole["param_groups"] for i in g["params"]]
        if sorted(saved) != list(range(len(order))):
            raise problem(
                f"{found.path} holds {key}= for {len(saved)} parameters in {len(whole['param_groups'])} "
                f"group(s); this optimizer has {len(order)} in {len(opt.param_groups)}",
                "Build the optimizer as the run that saved it did (the same parameters, in the same order), "
                "or load only the model and start the optimizer afresh",
            )
        groups = [{**g, "params": [order[int(i)] for i in g["params"]]} for g in whole["param_groups"]]
        state = {order[int(i)]: v for i, v in whole["state"].items()}
        by_name: dict[str, Any] = {"state": state, "param_groups": groups}
        options = StateDictOptions(full_state_dict=True, strict=strict)
        set_optimizer_state_dict(model, opt, by_name, options=options)
