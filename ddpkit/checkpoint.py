"""Save and resume the whole training state, exactly: `s.save(root, **state)` / `s.load(root, **state)`.

    values = s.load("runs/ckpt", model=model, optimizer=opt, scheduler=sched, loader=train, step=0)
    step = values["step"]                     # saved value, or the default on a fresh start
    for epoch in range(train.epoch, epochs):  # a resumed epoch continues after its last saved batch
        for x, y in train:
            ...
            step += 1
            if step % 100 == 0:
                s.save("runs/ckpt", model=model, optimizer=opt, scheduler=sched, loader=train, step=step)

What each keyword becomes (see `ddpkit.checkpoint_files` for the directory layout):
- an `nn.Module`: its unwrapped weights in `<name>.safetensors` (no `module.` prefix; plain
  `model.load_state_dict(safetensors.torch.load_file(...))` reads them), written by global rank 0;
- a ddpkit loader or a `torch.Generator`: per rank (position in the epoch, generator state);
- anything with `state_dict()`/`load_state_dict()` (optimizer, LR scheduler, GradScaler): saved from
  global rank 0, whose state every rank shares in data-parallel training (an optimizer whose steps are
  sharded, `ddpkit.sharding`, is gathered to rank 0 first, so the file always holds its full state);
- anything else (step, epoch, best loss): a value, returned by `load` (passed to `load`, a default);
  a keyword set to None is left out (handy for optional objects such as a scaler).
Every rank also saves its torch, CUDA, numpy and Python RNG states, and gets them back on `load`.

`load(root)` resumes from the newest checkpoint that verifies, says which newer ones it skipped and
why, and returns the defaults when `root` holds none yet (a fresh start); `load(root/"ckpt-000004")`
loads that one or fails. At another world size the global batch and the data position are kept
(the sampler's order does not depend on the world size) and the changes are printed.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ddpkit import checkpoint_dcp, lifecycle
from ddpkit import checkpoint_files as files
from ddpkit.checkpoint_files import CheckpointError, Found, Tensors
from ddpkit.data import ShardedLoader
from ddpkit.errors import problem
from ddpkit.wrap import unwrap

__all__ = ["CheckpointError", "export", "latest", "load", "save"]

_counters: dict[str, int] = {}


def _rank_files(rank: int) -> tuple[str, str]:
    return f"rank-{rank:05d}.json", f"rank-{rank:05d}.safetensors"


def _require_safe_torch() -> None:
    major, minor = (int(p) for p in torch.__version__.split(".")[:2])
    if (major, minor) < (2, 10):
        raise problem(
            f"torch {torch.__version__} is older than 2.10, whose weights-only loader has no known bypass",
            "Upgrade torch (pip install 'torch>=2.10') before saving or loading checkpoints",
        )


def _split(state: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Sort the keywords into modules, per-rank objects, shared objects and plain values."""
    parts: dict[str, dict[str, Any]] = {"modules": {}, "per_rank": {}, "shared": {}, "values": {}}
    for name, obj in state.items():
        if obj is None:
            continue
        if isinstance(obj, nn.Module):
            if name == "state":
                raise problem("a module cannot be saved under the name 'state' (a reserved file name)",
                              "Pick another keyword, e.g. model=")  # fmt: skip
            parts["modules"][name] = obj
        elif isinstance(obj, (ShardedLoader, torch.Generator)):
            parts["per_rank"][name] = obj
        elif callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
            parts["shared"][name] = obj
        else:
            parts["values"][name] = obj
    return parts


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def _per_rank_state(obj: Any) -> Any:
    return obj.get_state() if isinstance(obj, torch.Generator) else obj.state_dict()


# -- save -------------------------------------------------------------------------------------------
def save(session: Any, path: str | Path, *, keep: int = 3, **state: Any) -> Path:
    """Write a new checkpoint under `path` atomically; keep the newest `keep`; return its directory.

    Every rank must call it at the same point. Rank 0 writes the shared files, every rank its own;
    the others wait for rank 0 through the store for up to `save_timeout`, not in a collective.
    """
    _require_safe_torch()
    if keep < 1:
        raise problem(f"keep={keep} would delete the checkpoint just written", "Pass keep=1 or more")
    root = Path(path)
    if files.is_checkpoint(root):
        raise problem(f"{root} is a checkpoint, not a folder of checkpoints",
                      f"Save to its parent folder {root.parent}")  # fmt: skip
    parts = _split(state)
    sharded = checkpoint_dcp.split(session, parts)
    # collectives, while every rank is here (before any wait): whole optimizer states of sharded
    # steps, and the full weights of modules whose strategy shards them without a sharded checkpoint
    gathered = _gather_sharded(session, parts["shared"])
    weights = {name: _full_weights(session, module) for name, module in parts["modules"].items()}
    sync = _Sync(session, "save")
    if session.is_main:
        try:
            root.mkdir(parents=True, exist_ok=True)
            seq = files.next_seq(root)
            files.tmp_dir(root, seq).mkdir()
            if sharded is not None:
                (files.tmp_dir(root, seq) / checkpoint_dcp.DIRECTORY).mkdir()
        except OSError as err:
            sync.publish("dir", f"error: rank 0: {err}")  # the others stop waiting
            raise
        sync.publish("dir", str(seq))
    else:
        seq = int(sync.wait_one(0, "dir", "rank 0 to start the checkpoint"))
    tmp = files.tmp_dir(root, seq)
    try:
        listed = {}
        if sharded is not None:  # a collective; DCP reports an error on any rank to every rank
            model, optimizers = sharded
            state_dicts = session.strategy.sharded_state(model[1], optimizers)
            listed.update(checkpoint_dcp.save({model[0]: state_dicts.pop("model"), **state_dicts}, tmp,
                                              session.rank))  # fmt: skip
        listed.update(_write_rank(tmp, session.rank, parts["per_rank"]))
        sync.publish(f"rank{session.rank}", json.dumps(listed))
    except Exception as err:
        sync.publish(f"rank{session.rank}", f"error: rank {session.rank}: {err}")
        raise
    if session.is_main:
        final = _write_shared_and_commit(session, root, seq, parts, listed, sync, keep, gathered, weights,
                                         sharded)  # fmt: skip
    else:
        final = Path(sync.wait_one(0, "done", f"rank 0 to write checkpoint {seq}"))
    session.print(f"ddpkit: saved {final}" + (f" (step {state['step']})" if "step" in state else ""))
    return final


def _write_rank(tmp: Path, rank: int, per_rank: Mapping[str, Any]) -> dict[str, Any]:
    tensors = Tensors()
    tree = {
        "rng": files.encode(_rng_state(), tensors, "rng"),
        "objects": {n: files.encode(_per_rank_state(o), tensors, n) for n, o in per_rank.items()},
    }
    json_name, tensor_name = _rank_files(rank)
    return {
        tensor_name: files.write_tensors(tmp / tensor_name, tensors),
        json_name: files.write_json(tmp / json_name, tree),
    }


def _full_weights(session: Any, module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's full weights (on rank 0 at least); a collective where the strategy shards them."""
    strategy = session.strategy
    return strategy.full_state(module) if strategy.owns(module) else unwrap(module).state_dict()


def export(session: Any, path: str | Path, model: nn.Module) -> Path | None:
    """Write the full weights of `model` to one plain safetensors file (for inference); every rank calls
    it (under FSDP the shards are gathered to global rank 0, which writes). The path on rank 0."""
    weights = _full_weights(session, model)  # collective where sharded
    target = Path(path)
    if session.is_main:
        target.parent.mkdir(parents=True, exist_ok=True)
        tensors = Tensors()
        for key, value in weights.items():
            tensors[key] = files.own_storage(value.detach(), tensors)
        partial = target.with_name(f".{target.name}.tmp")
        files.write_tensors(partial, tensors)
        partial.replace(target)
    session.barrier()
    session.print(f"ddpkit: exported {len(weights)} tensors of the full model to {target}")
    return target if session.is_main else None


def _gather_sharded(session: Any, shared: Mapping[str, Any]) -> dict[str, Any]:
    """The full state of optimizers whose steps are sharded (`ddpkit.sharding`), on rank 0."""
    return {name: session.stepper.optimizer_state(obj) for name, obj in shared.items()
            if session.stepper.sharded_step(obj) is not None}  # fmt: skip


def _write_shared_and_commit(session: Any, root: Path, seq: int, parts: dict[str, dict[str, Any]],
                             listed: dict[str, Any], sync: _Sync, keep: int, gathered: Mapping[str, Any],
                             weights: Mapping[str, Mapping[str, torch.Tensor]],
                             sharded: tuple[tuple[str, Any], dict] | None) -> Path:  # fmt: skip
    tmp, final = files.tmp_dir(root, seq), files.final_dir(root, seq)
    try:
        entries: dict[str, Any] = dict(listed)
        for name, state_dict in weights.items():
            tensors_of = Tensors()
            for key, value in state_dict.items():
                tensors_of[key] = files.own_storage(value.detach(), tensors_of)
            entries[f"{name}.safetensors"] = files.write_tensors(tmp / f"{name}.safetensors", tensors_of)
        tensors = Tensors()
        tree = {
            "objects": {
                n: files.encode(gathered[n] if n in gathered else o.state_dict(), tensors, n)
                for n, o in parts["shared"].items()
            },
            "values": {n: files.encode(v, tensors, f"values/{n}") for n, v in parts["values"].items()},
        }
        entries["state.safetensors"] = files.write_tensors(tmp / "state.safetensors", tensors)
        entries["state.json"] = files.write_json(tmp / "state.json", tree)
        for r in range(1, session.world_size):
            answer = sync.wait_one(r, f"rank{r}", f"rank {r} to write its part of checkpoint {seq}")
            entries.update(json.loads(answer))
        values = tree["values"]
        objects = {kind: sorted(parts[kind]) for kind in ("modules", "per_rank", "shared", "values")}
        if sharded is not None:
            objects["sharded"] = sorted([sharded[0][0], *sharded[1]])
        files.write_manifest(tmp, {
            "seq": seq, "created": time.time(), "torch": torch.__version__, "world_size": session.world_size,
            "step": values.get("step") if isinstance(values.get("step"), int) else None,
            "strategy": session.strategy.name, "objects": objects, "files": entries,
        })  # fmt: skip
        files.commit(tmp, final)
        files.prune(root, keep, seq)
    except Exception as err:
        shutil.rmtree(tmp, ignore_errors=True)
        sync.publish("done", f"error: rank 0: {err}")
        raise
    sync.publish("done", str(final))
    return final


class _Sync:
    """Keys in the c10d store for one save or load, polled with the save timeout (no collective)."""

    def __init__(self, session: Any, what: str) -> None:
        self.session = session
        self.timeout = session.limits.save
        self.store = None
        if session.distributed:
            self.store, prefix = lifecycle.coordination()
            count = _counters[prefix] = _counters.get(prefix, 0) + 1
            self.prefix = f"{prefix}/{what}/{count}"

    def publish(self, key: str, value: str) -> None:
        if self.store is not None:
            self.store.set(f"{self.prefix}/{key}", value)

    def wait_one(self, rank: int, key: str, what: str) -> str:
        if self.store is None:
            raise RuntimeError("single process: nothing to wait for")  # not reached
        (raw,) = lifecycle.wait_for_keys(self.store, [f"{self.prefix}/{key}"], self.timeout, what)
        value = raw.decode()
        if value.startswith("error: "):
            raise problem(f"the checkpoint failed on {value[7:]}",
                          "See that rank's error above; the previous checkpoint is untouched")  # fmt: skip
        return value


# -- load -------------------------------------------------------------------------------------------
def latest(path: str | Path) -> Path | None:
    """The newest checkpoint under `path` whose files all verify, or None."""
    found, _ = files.newest_valid(Path(path))
    return found.path if found else None


def load(session: Any, path: str | Path, *, strict: bool = True, **state: Any) -> dict[str, Any]:
    """Restore the objects passed as keywords from the newest valid checkpoint; return the values.

    Plain keywords (step=0) are defaults for values the checkpoint lacks, and the whole answer on a
    fresh start. `strict` applies to module weights (missing or unexpected keys are errors).
    """
    _require_safe_torch()
    parts = _split(state)
    sharded = checkpoint_dcp.split(session, parts)
    found = _choose(session, Path(path))
    if found is None:
        session.print(f"ddpkit: no checkpoint in {path} yet: starting fresh")
        return dict(parts["values"])
    manifest = found.manifest
    saved = {name for names in manifest["objects"].values() for name in names}
    wanted = set(parts["modules"]) | set(parts["per_rank"]) | set(parts["shared"])
    if sharded is not None:
        wanted |= {sharded[0][0], *sharded[1]}
    if wanted - saved:
        raise problem(
            f"{found.path} has no {', '.join(sorted(wanted - saved))} (it holds {', '.join(sorted(saved))})",
            "Pass only what was saved, or save it from now on (an older checkpoint cannot gain it)",
        )
    if sharded is not None:
        checkpoint_dcp.load_into(session, found, sharded, strict=strict)
    for name, module in parts["modules"].items():
        weights = found.read_tensors(f"{name}.safetensors")
        if session.strategy.owns(module):
            session.strategy.load_full_state(module, weights, strict=strict)
        else:
            unwrap(module).load_state_dict(weights, strict=strict)
    shared = found.read_json("state.json")
    shared_tensors = found.read_tensors("state.safetensors")
    for name, obj in parts["shared"].items():
        obj.load_state_dict(files.decode(shared["objects"][name], shared_tensors))
        session.stepper.loaded_optimizer_state(obj)  # a sharded step keeps only this rank's share
    notes = _restore_per_rank(session, found, parts["per_rank"])
    values = {**parts["values"], **files.decode(shared["values"], shared_tensors)}
    _say_resumed(session, found, values, notes)
    return values


def _choose(session: Any, root: Path) -> Found | None:
    """Rank 0 picks the checkpoint (verifying every file); the others read its choice from the store."""
    sync = _Sync(session, "load")
    if not session.is_main:
        answer = json.loads(sync.wait_one(0, "choice", "rank 0 to choose a checkpoint"))
        if answer.get("path") is None:
            return None
        chosen = Path(answer["path"])  # each rank re-checks the files it reads against this manifest
        return files.Found(chosen, json.loads((chosen / files.MANIFEST).read_text()))
    try:
        if files.is_checkpoint(root):
            found, skipped = files.verify(root), []
        else:
            found, skipped = files.newest_valid(root)
            if found is None and skipped:
                raise CheckpointError(
                    f"every checkpoint in {root} is damaged:\n  " + "\n  ".join(skipped) + "\nRestore one "
                    "from a backup, or delete the folder to start afresh (nothing usable is left)."
                )
    except Exception as err:
        sync.publish("choice", f"error: rank 0: {err}")  # the others stop waiting, with the reason
        raise
    for line in skipped:
        session.print(f"ddpkit: skipped a damaged checkpoint: {line}")
    sync.publish("choice", json.dumps({"path": str(found.path) if found else None}))
    return found


def _restore_per_rank(session: Any, found: Found, per_rank: Mapping[str, Any]) -> list[str]:
    saved_world = int(found.manifest["world_size"])
    own = session.rank < saved_world
    json_name, tensor_name = _rank_files(session.rank if own else 0)
    tree = found.read_json(json_name)
    tensors = found.read_tensors(tensor_name)
    if own:
        _set_rng_state(files.decode(tree["rng"], tensors))
    notes = []
    if saved_world != session.world_size:
        notes.append(f"world size {saved_world} -> {session.world_size}")
        if session.world_size > saved_world:
            notes.append(f"ranks {saved_world}..{session.world_size - 1} start fresh RNG streams")
        else:
            notes.append(f"the RNG streams of ranks {session.world_size}..{saved_world - 1} are dropped")
    for name, obj in per_rank.items():
        value = files.decode(tree["objects"][name], tensors)
        if isinstance(obj, torch.Generator):
            if own:
                obj.set_state(value)
            continue
        obj.load_state_dict(value if own else dict(value, generator=None))
        if isinstance(obj, ShardedLoader):
            notes.append(_describe_position(name, value, obj))
    return notes


def _describe_position(name: str, old: Mapping[str, Any], loader: ShardedLoader) -> str:
    """The data position, and what a change of world size, accumulation or batch did to it.

    Like is compared with like: the true global batch (per rank x world x accumulation), so trading
    accumulation steps for ranks keeps it. Checkpoints from before `accumulation` was saved stored
    per rank x world as their global batch, which is the true one when they did not accumulate.
    """
    batch = loader.batch
    now, was_accumulation = batch.global_size, int(old.get("accumulation", 1))
    split = f"{batch.world_size} x {batch.per_rank} x {batch.accumulation}"
    was = f"{old['world_size']} x {old['per_rank_batch']} x {was_accumulation}"
    text = f"{name} at epoch {old['epoch']}, sample {old['samples']}"
    if old["global_batch"] != now:
        return f"{text}; the global batch changed {old['global_batch']} -> {now}, so the rest differs"
    if (old["world_size"], was_accumulation) != (batch.world_size, batch.accumulation):
        return f"{text}, global batch {now} kept (ranks x per rank x accumulation: {was} -> {split})"
    return text


def _say_resumed(session: Any, found: Found, values: Mapping[str, Any], notes: list[str]) -> None:
    step = values.get("step")
    head = f"ddpkit: resumed from {found.path}" + (f" (step {step})" if step is not None else "")
    session.print("; ".join([head, *notes]))
