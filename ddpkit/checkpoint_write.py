"""One save, in three steps: `capture` the state, `start` the checkpoint, `write` and commit it.

    snapshot = capture(ctx, state, copy=False)   # every rank, in step: gathers, encodes to CPU memory
    job = start(ctx, root, snapshot, keep=3)      # rank 0 opens .ckpt-000005.tmp/; the others learn 5
    final = write(ctx, job, snapshot)             # files, checksums; rank 0 commits when all are in

Why three: `capture` holds every collective a save needs (whole optimizer states of sharded steps,
full weights of sharded models), so it must run on the main thread with every rank; after it, the
state lives in CPU memory (`copy=True` clones every tensor, so training may go on and change the
originals), and `write` needs no collective (ranks meet through the store), so it may run behind
training (`ddpkit.checkpoint_background`). The exception is FSDP's DCP shards, written by a
collective inside `write`: those saves stay on the main thread.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ddpkit import checkpoint_dcp, checkpoint_state
from ddpkit import checkpoint_files as files
from ddpkit.checkpoint_files import Tensors
from ddpkit.checkpoint_sync import CheckpointContext, Sync
from ddpkit.wrap import unwrap


@dataclass
class Snapshot:
    """The state of one save, encoded: JSON trees and the tensors they point to (rank 0 holds the
    shared part; every rank its own part)."""

    objects: dict[str, list[str]]  # kind -> names, for the manifest
    step: int | None
    strategy: str
    rank_tree: Any
    rank_tensors: Tensors
    weights: dict[str, Tensors] = field(default_factory=dict)  # rank 0: name -> its weights
    shared_tree: Any = None  # rank 0: objects and values
    shared_tensors: Tensors = field(default_factory=Tensors)
    sharded: tuple[tuple[str, Any], dict] | None = None  # FSDP: (name, model), optimizers (DCP)

    def nbytes(self) -> int:
        groups = [self.rank_tensors, self.shared_tensors, *self.weights.values()]
        return sum(t.numel() * t.element_size() for g in groups for t in g.values())


@dataclass(frozen=True)
class Job:
    """A started checkpoint: its root, sequence number and the store keys the ranks meet under."""

    root: Path
    seq: int
    keep: int
    sync: Sync

    @property
    def tmp(self) -> Path:
        return files.tmp_dir(self.root, self.seq)


def capture(ctx: CheckpointContext, state: dict[str, Any], *, copy: bool) -> Snapshot:
    """Every rank, at the same point: the collectives of a save, then the state encoded in memory."""
    parts = checkpoint_state.split(state)
    sharded = checkpoint_dcp.split(ctx.strategy, parts)
    # collectives, while every rank is here: whole optimizer states of sharded steps, and the full
    # weights of modules whose strategy shards them without a sharded checkpoint
    gathered = {name: ctx.optimizers.optimizer_state(obj) for name, obj in parts["shared"].items()
                if ctx.optimizers.sharded_step(obj) is not None}  # fmt: skip
    weights = {name: full_weights(ctx, module) for name, module in parts["modules"].items()}
    objects = {kind: sorted(parts[kind]) for kind in ("modules", "per_rank", "shared", "values")}
    if sharded is not None:
        objects["sharded"] = sorted([sharded[0][0], *sharded[1]])
    step = parts["values"].get("step")
    rank_tensors = Tensors()
    snap = Snapshot(objects, step if isinstance(step, int) else None, ctx.strategy.name,
                    checkpoint_state.per_rank_tree(parts["per_rank"], rank_tensors), rank_tensors,
                    sharded=sharded)  # fmt: skip
    if ctx.is_main:
        for name, state_dict in weights.items():
            snap.weights[name] = Tensors()
            for key, value in state_dict.items():
                snap.weights[name][key] = files.own_storage(value.detach(), snap.weights[name])
        tensors = snap.shared_tensors
        snap.shared_tree = {
            "objects": {
                n: files.encode(gathered[n] if n in gathered else o.state_dict(), tensors, n)
                for n, o in parts["shared"].items()
            },
            "values": {n: files.encode(v, tensors, f"values/{n}") for n, v in parts["values"].items()},
        }
    if copy:
        for group in (snap.rank_tensors, snap.shared_tensors, *snap.weights.values()):
            for key, value in group.items():
                group[key] = value.clone()
    return snap


def full_weights(ctx: CheckpointContext, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's full weights (on rank 0 at least); a collective where the strategy shards them."""
    strategy = ctx.strategy
    return strategy.full_state(module) if strategy.owns(module) else unwrap(module).state_dict()


def start(ctx: CheckpointContext, root: Path, snap: Snapshot, keep: int) -> Job:
    """Rank 0 opens the temporary directory and tells the others its number (through the store)."""
    sync = Sync(ctx, "save")
    if ctx.is_main:
        try:
            root.mkdir(parents=True, exist_ok=True)
            seq = files.next_seq(root)
            files.tmp_dir(root, seq).mkdir()
            if snap.sharded is not None:
                (files.tmp_dir(root, seq) / checkpoint_dcp.DIRECTORY).mkdir()
        except OSError as err:
            sync.publish("dir", f"error: rank 0: {err}")  # the others stop waiting
            raise
        sync.publish("dir", str(seq))
    else:
        seq = int(sync.wait_one(0, "dir", "rank 0 to start the checkpoint"))
    return Job(root, seq, keep, sync)


def write(
    ctx: CheckpointContext, job: Job, snap: Snapshot, sharded_written: Callable[[], dict] | None = None
) -> Path:
    """Write this rank's files; rank 0 also the shared ones, then the manifest and the atomic rename.

    The checkpoint exists only once every rank's part is in: the others wait for rank 0's "done".
    `sharded_written`: FSDP's shards were handed to DCP's async_save (`checkpoint_dcp.save_async`);
    wait for them here, behind training, instead of writing them now.
    """
    listed: dict[str, Any] = {}
    try:
        if sharded_written is not None:
            listed.update(sharded_written())
        elif snap.sharded is not None:  # a collective; DCP reports an error on any rank to every rank
            (name, model), optimizers = snap.sharded
            state_dicts = ctx.strategy.sharded_state(model, optimizers)
            state = {name: state_dicts.pop("model"), **state_dicts}
            listed.update(checkpoint_dcp.save(state, job.tmp, ctx.rank))
        listed.update(checkpoint_state.write_rank(job.tmp, ctx.rank, snap.rank_tree, snap.rank_tensors))
        job.sync.publish(f"rank{ctx.rank}", json.dumps(listed))
    except Exception as err:
        job.sync.publish(f"rank{ctx.rank}", f"error: rank {ctx.rank}: {err}")
        raise
    if ctx.is_main:
        final = _write_shared_and_commit(ctx, job, snap, listed)
    else:
        final = Path(job.sync.wait_one(0, "done", f"rank 0 to write checkpoint {job.seq}"))
    ctx.say(f"ddpkit: saved {final}" + (f" (step {snap.step})" if snap.step is not None else ""))
    return final


def _write_shared_and_commit(
    ctx: CheckpointContext, job: Job, snap: Snapshot, listed: dict[str, Any]
) -> Path:
    tmp, final = job.tmp, files.final_dir(job.root, job.seq)
    try:
        entries: dict[str, Any] = dict(listed)
        for name, tensors in snap.weights.items():
            entries[f"{name}.safetensors"] = files.write_tensors(tmp / f"{name}.safetensors", tensors)
        entries["state.safetensors"] = files.write_tensors(tmp / "state.safetensors", snap.shared_tensors)
        entries["state.json"] = files.write_json(tmp / "state.json", snap.shared_tree)
        for r in range(1, ctx.world_size):
            answer = job.sync.wait_one(r, f"rank{r}", f"rank {r} to write its part of checkpoint {job.seq}")
            entries.update(json.loads(answer))
        files.write_manifest(tmp, {
            "seq": job.seq, "created": time.time(), "torch": torch.__version__, "world_size": ctx.world_size,
            "step": snap.step, "strategy": snap.strategy, "objects": snap.objects, "files": entries,
        })  # fmt: skip
        files.commit(tmp, final)
        files.prune(job.root, job.keep, job.seq)
    except Exception as err:
        shutil.rmtree(tmp, ignore_errors=True)
        job.sync.publish("done", f"error: rank 0: {err}")
        raise
    job.sync.publish("done", str(final))
    return final
