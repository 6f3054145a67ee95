"""One save, in three steps: `capture` the state, `start` the checkpoint, `write` and commit it.

    snapshot = capture(ctx, state, copy=False)   # every rank, in step: the state encoded, a frozen value
    job = start(ctx, root, snapshot, Retention(3))  # rank 0 opens .ckpt-000005.tmp/; the others learn 5
    final = write(ctx, job, snapshot)             # gathers, files, checksums; rank 0 commits when all are in

Why three: `capture` runs on the main thread with every rank, at the same point, and leaves the state
in memory (`copy=True` clones every tensor, so training may go on and change the originals): full
weights of sharded models (a collective), each sharded step's optimizer share (`checkpoint.gather`),
FSDP's DCP state assembled once (`checkpoint.dcp.assemble`; staged, i.e. copied, in the background).
`write` needs no collective on training's group: the two collectives left in a save, the optimizer
shares gathered to rank 0 (`collectives.gather_state`) and DCP's save, run over `job.group`, which is the
one route of the writer's group: None (training's group) in a synchronous save, the checkpoints' own
gloo group in a background one, where `write` runs behind training (`ddpkit.checkpoint.background`).
Ranks meet through the store. The snapshot is never changed after `capture`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ddpkit.checkpoint import dcp as checkpoint_dcp
from ddpkit.checkpoint import files
from ddpkit.checkpoint import state as checkpoint_state
from ddpkit.checkpoint.divergence import note
from ddpkit.checkpoint.files import Tensors
from ddpkit.checkpoint.gather import local_share
from ddpkit.checkpoint.remote import Remote
from ddpkit.checkpoint.retention import Retention, prune
from ddpkit.checkpoint.sync import CheckpointContext, Sync
from ddpkit.parallel.collectives import gather_state
from ddpkit.parallel.modules import unwrap


@dataclass(frozen=True)
class Snapshot:
    """The state of one save, encoded, taken by `capture` and never changed after: JSON trees and the
    tensors they point to (rank 0 holds the shared part; every rank its own part)."""

    objects: Mapping[str, list[str]]  # kind -> names, for the manifest
    step: int | None
    strategy: str
    rank_tree: dict[str, Any]  # this rank's RNG streams and per-rank objects
    rank_tensors: Tensors
    weights: Mapping[str, Tensors]  # rank 0: module name -> its full weights
    shared_tree: dict[str, Any] | None  # rank 0: shared objects and values (None elsewhere)
    shared_tensors: Tensors
    shares: Mapping[str, dict[str, Any]]  # sharded steps: this rank's optimizer share, gathered by `write`
    dcp: dict[str, Any] | None  # FSDP: the model's and its optimizers' state for DCP (staged: a copy)
    notes: Mapping[str, str]  # name -> the line saying it went per rank (its state differs between ranks)
    metrics: Mapping[str, float] = field(default_factory=dict)  # the numeric values, for `keep_best`

    def nbytes(self) -> int:
        groups = [self.rank_tensors, self.shared_tensors, *self.weights.values()]
        return sum(t.numel() * t.element_size() for g in groups for t in g.values())


@dataclass(frozen=True)
class Job:
    """A started checkpoint: its root, sequence number, the store keys the ranks meet under, and the
    process group `write`'s collectives run over (None: training's; a background save: its own)."""

    root: Path
    seq: int
    keep: Retention
    sync: Sync
    group: Any = None
    out: Callable[[Path, dict[str, torch.Tensor]], dict[str, Any]] | None = None  # None: `stream_tensors`
    remote: Remote | None = None  # an fsspec root: rank 0 uploads the committed checkpoint to it
    process: Any = None  # background="process": the `WriterProcess` that writes DCP's shards too

    @property
    def tmp(self) -> Path:
        return files.tmp_dir(self.root, self.seq)


def capture(
    ctx: CheckpointContext,
    state: dict[str, Any],
    *,
    copy: bool,
    stage: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Snapshot:
    """Every rank, at the same point: the state encoded in memory (copied when `copy`), a frozen value.
    `stage` makes the copies (default: a clone; the writer process: into its shared memory)."""
    parts = checkpoint_state.split(state)
    diverged, own = (  # one all-gather, or none
        checkpoint_state.differing(parts["shared"], parts["values"], ctx.device)
        if ctx.distributed
        else ([], [])
    )
    for name in diverged:
        parts["per_rank"][name] = parts["shared"].pop(name)
    sharded = checkpoint_dcp.split(ctx.strategy, parts)
    fresh: set[int] = set()  # storages already copied to CPU here (GPU tensors): not copied twice
    stepped = [n for n, obj in parts["shared"].items() if ctx.optimizers.sharded_step(obj) is not None]
    shares = {n: local_share(parts["shared"][n], fresh, to_cpu, copy=copy, stage=stage) for n in stepped}
    weights = {name: full_weights(ctx, module) for name, module in parts["modules"].items()}  # collective
    dcp_state = None
    if sharded is not None:
        dcp_state = checkpoint_dcp.assemble(ctx.strategy, sharded)
        dcp_state = checkpoint_dcp.stage(dcp_state, stage) if copy else dcp_state
    objects = {kind: sorted(parts[kind]) for kind in ("modules", "per_rank", "shared", "values")}
    if sharded is not None:
        objects["sharded"] = sorted([sharded[0][0], *sharded[1]])
    step = parts["values"].get("step")
    rank_tensors, shared_tensors = Tensors(), Tensors()
    own_values = {n: parts["values"][n] for n in own}  # each rank's; rank 0's also with the other values
    rank_tree = checkpoint_state.per_rank_tree(parts["per_rank"], rank_tensors, own_values)
    kept: dict[str, Tensors] = {}
    shared_tree = None
    if ctx.is_main:
        for name, state_dict in weights.items():
            kept[name] = Tensors()
            for key, value in state_dict.items():
                value = to_cpu(value.detach(), fresh) if copy else value.detach()
                kept[name][key] = files.own_storage(value, kept[name])
        shared = {n: o.state_dict() for n, o in parts["shared"].items() if n not in shares}
        shared_tree = {
            "objects": {
                n: files.encode(to_cpu(v, fresh) if copy else v, shared_tensors, n) for n, v in shared.items()
            },
            "values": {n: files.encode(v, shared_tensors, f"values/{n}") for n, v in parts["values"].items()},
        }  # (shares: encoded by `write` once gathered)
    if copy:
        if fresh and torch.cuda.is_available():
            torch.cuda.synchronize()  # the pinned copies were asynchronous
        for group in (rank_tensors, shared_tensors, *kept.values()):
            for key, value in group.items():
                if value.untyped_storage().data_ptr() not in fresh:
                    group[key] = stage(value) if stage is not None else value.clone()
    notes = {n: note(n, parts["per_rank"][n]) for n in diverged}
    if own:
        notes[", ".join(own)] = checkpoint_state.values_note(own)  # one line (once a session)
    values = parts["values"].items()
    metrics = {n: v for n, v in values if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return Snapshot(
        objects,
        step if isinstance(step, int) else None,
        ctx.strategy.name,
        rank_tree,
        rank_tensors,
        kept,
        shared_tree,
        shared_tensors,
        shares,
        dcp_state,
        notes,
        metrics,
    )


def to_cpu(tree: Any, fresh: set[int]) -> Any:
    """`tree` with its GPU tensors copied to pinned CPU memory (asynchronous DMA copies: synchronize
    before reading them); CPU tensors are left for the caller's clone. `fresh` collects the copies."""
    if isinstance(tree, torch.Tensor):
        if tree.device.type == "cpu":
            return tree
        pinned = torch.empty(tree.shape, dtype=tree.dtype, pin_memory=torch.cuda.is_available())
        pinned.copy_(tree, non_blocking=pinned.is_pinned())
        fresh.add(pinned.untyped_storage().data_ptr())
        return pinned
    if isinstance(tree, dict):
        return {k: to_cpu(v, fresh) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_cpu(v, fresh) for v in tree)
    return tree


def full_weights(ctx: CheckpointContext, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's full weights (on rank 0 at least); a collective where the strategy shards them."""
    strategy = ctx.strategy
    return strategy.full_state(module) if strategy.owns(module) else unwrap(module).state_dict()


def start(
    ctx: CheckpointContext,
    root: Path,
    snap: Snapshot,
    keep: Retention,
    group: Any = None,
    out: Callable[[Path, dict[str, torch.Tensor]], dict[str, Any]] | None = None,
    remote: Remote | None = None,
    process: Any = None,
) -> Job:
    """Rank 0 opens the temporary directory and tells the others its number (through the store);
    `group` is the process group of `write`'s collectives (None: training's); `out` writes the big
    tensor files (None: `stream_tensors` on this thread; the writer process's `write_file`); `remote`:
    the store the checkpoint goes to after its local commit (`root` is then its local folder);
    `process`: the writer process, which then writes this rank's DCP shards as well."""
    sync = Sync(ctx, "save")
    if ctx.is_main:
        try:
            root.mkdir(parents=True, exist_ok=True)
            seq = files.next_seq(root)
            if remote is not None:  # above every number in the store too (unfinished uploads included)
                seq = max(seq, remote.next_seq())
            files.tmp_dir(root, seq).mkdir()
            if snap.dcp is not None:
                (files.tmp_dir(root, seq) / checkpoint_dcp.DIRECTORY).mkdir()
        except OSError as err:
            sync.publish("dir", f"error: rank 0: {err}")  # the others stop waiting
            raise
        sync.publish("dir", str(seq))
    else:
        seq = int(sync.wait_one(0, "dir", "rank 0 to start the checkpoint"))
    return Job(root, seq, keep, sync, group, out, remote, process)


def write(ctx: CheckpointContext, job: Job, snap: Snapshot) -> Path:
    """Write this rank's files; rank 0 also the shared ones, then the manifest and the atomic rename.

    The checkpoint exists only once every rank's part is in: the others wait for rank 0's "done".
    """
    listed: dict[str, Any] = {}
    gathered: dict[str, Any] = {}
    try:
        for name in sorted(snap.shares):  # the optimizer states of sharded steps, whole on rank 0
            full = gather_state(snap.shares[name], ctx.rank, ctx.world_size, job.group)
            if full is not None:
                gathered[name] = full
        if snap.dcp is not None:  # a collective; DCP reports an error on any rank to every rank
            listed.update(checkpoint_dcp.save(snap.dcp, job.tmp, ctx.rank, job.group, job.process))
        listed.update(checkpoint_state.write_rank(job.tmp, ctx.rank, snap.rank_tree, snap.rank_tensors))
        job.sync.publish(f"rank{ctx.rank}", json.dumps(listed))
    except Exception as err:
        job.sync.publish(f"rank{ctx.rank}", f"error: rank {ctx.rank}: {err}")
        if ctx.is_main:  # e.g. DCP's save failed on some rank (every rank raises): its partial files go
            shutil.rmtree(job.tmp, ignore_errors=True)
        raise
    if ctx.is_main:
        final = _write_shared_and_commit(ctx, job, snap, listed, gathered)
    else:
        final = Path(job.sync.wait_one(0, "done", f"rank 0 to write checkpoint {job.seq}"))
    ctx.say(f"ddpkit: saved {final}" + (f" (step {snap.step})" if snap.step is not None else ""))
    return final


def _write_shared_and_commit(
    ctx: CheckpointContext, job: Job, snap: Snapshot, listed: dict[str, Any], gathered: dict[str, Any]
) -> Path:
    tmp, final = job.tmp, files.final_dir(job.root, job.seq)
    assert snap.shared_tree is not None  # rank 0's
    shared = Tensors()  # the snapshot's shared tensors and the gathered optimizer states' (a new dict)
    shared.update(snap.shared_tensors)
    shared.storages |= snap.shared_tensors.storages
    objects = {**snap.shared_tree["objects"], **{n: files.encode(v, shared, n) for n, v in gathered.items()}}
    try:
        entries: dict[str, Any] = dict(listed)
        put = job.out or stream_tensors
        for name, tensors in snap.weights.items():
            entries[f"{name}.safetensors"] = put(tmp / f"{name}.safetensors", tensors)
        entries["state.safetensors"] = put(tmp / "state.safetensors", shared)
        entries["state.json"] = files.write_json(tmp / "state.json", {**snap.shared_tree, "objects": objects})
        for r in range(1, ctx.world_size):
            answer = job.sync.wait_one(r, f"rank{r}", f"rank {r} to write its part of checkpoint {job.seq}")
            entries.update(json.loads(answer))
        files.write_manifest(
            tmp,
            {
                "seq": job.seq,
                "created": time.time(),
                "torch": torch.__version__,
                "world_size": ctx.world_size,
                **({"layout": ctx.layout.as_dict()} if ctx.layout is not None else {}),  # how ranks divided
                "step": snap.step,
                "strategy": snap.strategy,
                "objects": snap.objects,
                "files": entries,
                "metrics": dict(snap.metrics),
            },
        )
        files.commit(tmp, final)
        prune(job.root, job.keep, job.seq)
        if job.remote is not None:
            _upload(ctx, job.remote, final, job.keep)
    except Exception as err:
        shutil.rmtree(tmp, ignore_errors=True)
        job.sync.publish("done", f"error: rank 0: {err}")
        raise
    job.sync.publish("done", str(final))
    return final


def _upload(ctx: CheckpointContext, remote: Remote, final: Path, keep: Retention) -> None:
    """Rank 0: the committed checkpoint to the store (the manifest last), then the store's retention."""
    try:
        url = remote.upload(final)
        remote.prune(keep, final.name)
    except Exception as err:
        raise files.CheckpointError(
            f"{final.name} is committed in the local folder {final.parent}, but its upload to {remote.url} "
            f"failed ({type(err).__name__}: {err}): the store's newest complete checkpoint is still the one "
            "before it. Check the store's address and credentials; the next save uploads a new checkpoint, "
            f"and a load on this machine resumes from the local copy"
        ) from err
    ctx.say(f"ddpkit: uploaded {final.name} to {url}")


_CHUNK = 1 << 20  # hashed, then written from the cache (`writer_child.CHUNK`: half the CPU of 8 MiB)


def stream_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """`files.write_tensors` for the writer thread: the same safetensors file, hashed while written.

    safetensors' `save_file` builds the file's bytes while holding the GIL, and the files were then
    read back to hash them; a writer thread that holds the GIL stalls training's thread (the more so
    at the lowest CPU priority). Here the tensors' memory goes to `write` and to SHA-256 in 1 MiB
    slices, both of which release the GIL, and nothing is read back. Other dtypes: `save_file`."""
    if any(t.dtype not in files.SAFETENSORS_DTYPES for t in tensors.values()):
        return files.write_tensors(path, tensors)
    head = files.safetensors_header(tensors.items(), {"format": files.FORMAT})
    digest = hashlib.sha256()
    with open(path, "wb", buffering=0) as f:
        f.write(head)
        digest.update(head)
        for t in tensors.values():
            if not t.numel():
                continue
            data = memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
            for start in range(0, len(data), _CHUNK):
                piece = data[start : start + _CHUNK]
                digest.update(piece)
                while piece:
                    piece = piece[f.write(piece) :]
        os.fsync(f.fileno())
    return {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}
