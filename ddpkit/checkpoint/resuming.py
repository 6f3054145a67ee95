"""Finding and restoring a checkpoint: which one a load takes, and how its state comes back.

    found, values = restore(ctx, "runs/ckpt", True, {"model": model, "step": 0})  # every rank
    latest("runs/ckpt")                         # the newest checkpoint that verifies, or None

Rank 0 chooses (`_choose`: verifying every file, skipping damaged ones, refusing a root another tool
wrote) and the others read its choice from the store; then every rank restores: FSDP's shards through
DCP (`ddpkit.checkpoint.dcp`), a sharded checkpoint loaded whole (`ddpkit.checkpoint.portable`), the
whole-model files, the shared and per-rank state. Saving is `ddpkit.checkpoint.write`; the facade the
session holds, `ddpkit.checkpoint.checkpoints`, calls both.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ddpkit.checkpoint import dcp as checkpoint_dcp
from ddpkit.checkpoint import files, portable
from ddpkit.checkpoint import state as checkpoint_state
from ddpkit.checkpoint.files import CheckpointError, Found
from ddpkit.checkpoint.remote import Remote
from ddpkit.checkpoint.sync import CheckpointContext, Sync
from ddpkit.errors import problem
from ddpkit.parallel.modules import unwrap


def latest(path: str | Path) -> Path | None:
    """The newest checkpoint under `path` whose files all verify, or None."""
    found, _ = files.newest_valid(Path(path))
    return found.path if found else None


def restore(
    ctx: CheckpointContext, path: str | Path, strict: bool, state: dict[str, Any]
) -> tuple[Path | None, dict[str, Any]]:
    """Restore the objects in `state` (the registered ones included) from the checkpoint `path` names:
    the one it is, or the newest valid one under it. Returns the checkpoint loaded (None on a fresh
    start) and the values, saved or the defaults given. Every rank calls it; the facade waits for a
    background save first (`Checkpoints.load`)."""
    parts = checkpoint_state.split(state)
    sharded = checkpoint_dcp.split(ctx.strategy, parts)
    remote = Remote.parse(path)
    found = _choose(ctx, remote.local if remote is not None else local_path(path), remote)
    if found is None:
        ctx.say(f"ddpkit: no checkpoint in {path} yet: starting fresh")
        return None, dict(parts["values"])
    manifest = found.manifest
    checkpoint_state.follow(parts, manifest["objects"])
    taken = portable.take(ctx.strategy, parts, manifest["objects"])  # FSDP's shards, loaded whole here
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
        checkpoint_dcp.load_into(ctx.strategy, found, sharded, strict=strict)
    if taken is not None:
        portable.load_whole(found, taken, strict=strict)
        for optimizer in taken.optimizers.values():
            ctx.optimizers.loaded_optimizer_state(optimizer)  # a sharded step keeps only its share
    for name, module in parts["modules"].items():
        weights = found.read_tensors(f"{name}.safetensors")
        if ctx.strategy.owns(module):
            ctx.strategy.load_full_state(module, weights, strict=strict)
        else:
            unwrap(module).load_state_dict(weights, strict=strict)
    shared = found.read_json("state.json")
    shared_tensors = found.read_tensors("state.safetensors")
    for name, obj in parts["shared"].items():
        obj.load_state_dict(files.decode(shared["objects"][name], shared_tensors))
        ctx.optimizers.loaded_optimizer_state(obj)  # a sharded step keeps only this rank's share
    notes = checkpoint_state.restore_per_rank(ctx.rank, ctx.world_size, found, parts["per_rank"])
    given = {**parts["values"], **files.decode(shared["values"], shared_tensors)}
    values = checkpoint_state.own_values(ctx.rank, ctx.world_size, found, given, asked=parts["values"])
    step = values.get("step")
    head = f"ddpkit: resumed from {found.path}" + (f" (step {step})" if step is not None else "")
    ctx.say("; ".join([head, *notes]))
    return found.path, values


def not_a_root(what: str) -> CheckpointError:
    """The refusal of a checkpoint root that holds something else (`files.foreign` says what)."""
    return CheckpointError(
        f"{what}: s.save and s.load take a folder that holds only ddpkit's checkpoints (ckpt-NNNNNN/), "
        "and starting fresh here would either ignore what is there or fail at the first save, after "
        "training. Pass a new or empty folder (e.g. runs/ckpt) for ddpkit's checkpoints; to start from "
        "weights another tool wrote, load them into the model first (s.model(..., weights=path) reads a "
        "safetensors file or a save_pretrained folder), or move them out of the way"
    )


def local_path(path: str | Path) -> Path:
    """A local root: a path, or a file:// URL."""
    text = str(path)
    return Path(text[len("file://") :]) if text.startswith("file://") else Path(path)


def _choose(ctx: CheckpointContext, root: Path, remote: Remote | None = None) -> Found | None:
    """Rank 0 picks the checkpoint (verifying every file; from an fsspec store, the newest complete one
    downloaded to the local folder first); the others read its choice from the store."""
    sync = Sync(ctx, "load")
    if not ctx.is_main:
        answer = json.loads(sync.wait_one(0, "choice", "rank 0 to choose a checkpoint"))
        if answer.get("path") is None:
            return None
        chosen = Path(answer["path"])  # each rank re-checks the files it reads against this manifest
        return files.Found(chosen, json.loads((chosen / files.MANIFEST).read_text()))
    found: Found | None
    try:
        if remote is not None:
            remote.pull(ctx.say)
        if files.is_checkpoint(root):
            found, skipped = files.verify(root), list[str]()
        else:
            found, skipped = files.newest_valid(root)
            if found is None and not skipped and (what := files.foreign(root)) is not None:
                raise not_a_root(what)  # before any training: "starting fresh" would lose or clash with it
            if found is None and skipped:
                raise CheckpointError(
                    f"every checkpoint in {root} is damaged:\n  " + "\n  ".join(skipped) + "\nRestore one "
                    "from a backup, or delete the folder to start afresh (nothing usable is left)."
                )
    except Exception as err:
        sync.publish("choice", f"error: rank 0: {err}")  # the others stop waiting, with the reason
        raise
    for line in skipped:
        ctx.say(f"ddpkit: skipped a damaged checkpoint: {line}")
    if found is not None and not files.is_checkpoint(root):
        for unfinished in files.unfinished_after(root, found.path):
            ctx.say(
                f"ddpkit: ignored {unfinished.name}: a save that never finished (the job ended "
                f"while it was written); {found.path.name} is the newest complete one"
            )
    sync.publish("choice", json.dumps({"path": str(found.path) if found else None}))
    return found
