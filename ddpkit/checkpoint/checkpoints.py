"""Save and resume the whole training state, exactly: `s.save(root, **state)` / `s.load(root, **state)`.

    values = s.load("runs/ckpt", model=model, optimizer=opt, scheduler=sched, loader=train, step=0)
    step = values["step"]                     # saved value, or the default on a fresh start
    for epoch in range(train.epoch, epochs):  # a resumed epoch continues after its last saved batch
        for x, y in train:
            ...
            step += 1
            if step % 100 == 0:
                s.save("runs/ckpt", model=model, optimizer=opt, scheduler=sched, loader=train, step=step)

What each keyword becomes (`ddpkit.checkpoint.state`; the directory layout is `ddpkit.checkpoint.files`):
- an `nn.Module`: its unwrapped weights in `<name>.safetensors` (no `module.` prefix; plain
  `model.load_state_dict(safetensors.torch.load_file(...))` reads them), written by global rank 0;
- a ddpkit loader or a `torch.Generator`: per rank (position in the epoch, generator state);
- anything with `state_dict()`/`load_state_dict()` (optimizer, LR scheduler, GradScaler): saved from
  global rank 0, whose state every rank shares in data-parallel training (an optimizer whose steps are
  sharded, `ddpkit.step.sharding`, is gathered to rank 0 first, so the file always holds its full state);
- anything else (step, epoch, best loss, a dict of JSON-able extras such as a tracker's run id): a
  value, returned by `load` (passed to `load`, a default); a keyword set to None is left out.
Every rank also saves its torch, CUDA, numpy and Python RNG states, and gets them back on `load`.

`load(root)` resumes from the newest checkpoint that verifies, says which newer ones it skipped and
why, and returns the defaults when `root` holds none yet (a fresh start); `load(root/"ckpt-000004")`
loads that one or fails. At another world size the global batch and the data position are kept
(the sampler's order does not depend on the world size) and the changes are printed.

A save is two phases: `capture` (every rank, in step: the collectives that gather sharded state,
and a copy of everything to CPU memory) and `write` (files, checksums, the manifest, the atomic
rename by rank 0), in `ddpkit.checkpoint.write`; `background=True` runs the second on a thread.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddpkit import names
from ddpkit.checkpoint import files, resuming
from ddpkit.checkpoint import retention as keeping
from ddpkit.checkpoint.background import NICE, Background, writer_group
from ddpkit.checkpoint.files import CheckpointError, Tensors
from ddpkit.checkpoint.memory import BUDDY_MODES, MemoryRecovery
from ddpkit.checkpoint.remote import Remote, export_target, export_via
from ddpkit.checkpoint.resuming import latest, local_path, not_a_root
from ddpkit.checkpoint.sync import CheckpointContext
from ddpkit.checkpoint.write import capture, full_weights, start, write
from ddpkit.checkpoint.writer_process import WriterProcess, writer_mode
from ddpkit.cluster.preemption import Preempted, Preemption
from ddpkit.errors import problem

__all__ = ["CheckpointContext", "CheckpointError", "Checkpoints", "Preempted", "latest"]

# Set by `ddpkit verify --resume-script` in the ranks it launches (ddpkit.verify.script_resume), nowhere else:
RECORD_ENV = names.VERIFY_RECORD_ENV  # a folder: each rank appends what every save, load and step saw
STOP_ENV = names.VERIFY_STOP_ENV  # "kill:K" or "signal:K": stop this process at its K-th optimizer step


def _require_safe_torch() -> None:
    major, minor = (int(p) for p in torch.__version__.split(".")[:2])
    if (major, minor) < (2, 10):
        raise problem(
            f"torch {torch.__version__} is older than 2.10, whose weights-only loader has no known bypass",
            "Upgrade torch (pip install 'torch>=2.10') before saving or loading checkpoints",
        )


class Checkpoints:
    """One session's checkpoints: save, load, export, and the background write in flight (if any).

    `context` is a value the session built (its strategy already built, so nothing here calls back);
    `preemption` is the job's stop policy, which the session owns (`ddpkit.cluster.preemption`): this
    facade only asks it at `every=` saves. Objects given to `register` (name -> anything with
    state_dict/load_state_dict, or a callable returning a JSON-able value) join every save and load,
    e.g. a tracker's run id.
    """

    def __init__(
        self, context: CheckpointContext, *, preemption: Preemption, writer_nice: int = NICE
    ) -> None:
        self._ctx = context
        self._background = Background(nice=writer_nice)
        self._nice = writer_nice
        self._process: WriterProcess | None = None  # background="process": started at its first save
        self._preemption = preemption
        self._registered: dict[str, Any] = {}
        self._writer_group: Any = None  # background saves' own process group (made once, at the first)
        self._remembered: tuple[str | Path, keeping.Retention, dict[str, Any]] | None = None  # last save/load
        self._steps_since = 0  # optimizer steps since then: how far its `step` value is behind
        self._stepping = False  # s.step was called: it agrees on a stop, at optimizer steps only
        self._saved = False  # s.save agreed since the loader's last batch
        self.last: Path | None = None  # the newest checkpoint this session committed or started
        self.found: tuple[str, dict[str, Any]] | None = None  # last save that wrote, or load that found
        self._noted: set[str] = set()  # objects a save kept per rank (their state differed), said once
        self._memory: MemoryRecovery | None = None  # s.load(..., memory=N): snapshots in the keeper
        self._record = _Recorder.from_env(context.rank)  # None unless verify --resume-script runs the script

    def register(self, name: str, obj: Any) -> None:
        """Save and load `obj` under `name` with every checkpoint of this session."""
        self._registered[name] = obj

    # -- save -----------------------------------------------------------------------------------
    def save(
        self,
        path: str | Path,
        *,
        keep: int = 3,
        keep_every: int | None = None,
        keep_best: str | tuple[str, str] | None = None,
        background: bool | str = False,
        every: int | None = None,
        **state: Any,
    ) -> Path | None:
        """Write a new checkpoint under `path` atomically; keep the newest `keep`; return its directory.

        Retention (on disk and in a remote store alike): the newest `keep`, plus every checkpoint whose
        step is a multiple of `keep_every`, plus the best by `keep_best`, a number passed to every save
        (`keep_best="val_loss"`: the lowest; `("accuracy", "max")`: the highest). `path` may be an
        fsspec URL (`s3://bucket/run`; `ddpkit.checkpoint.remote`).

        Every rank must call it at the same point. Rank 0 writes the shared files, every rank its own;
        the others wait for rank 0 through the store for up to `save_timeout`, not in a collective.
        With `background=True` the state is copied to CPU memory and the call returns; the files are
        written and committed behind training. The next save (and the session's end) waits for it.
        `background="process"` copies into shared memory instead, and a writer process of its own
        (`ddpkit.checkpoint.writer_process`) writes and hashes the big files out of training's
        interpreter; `background="thread"` is `True`.

        With `every=N`, call it after every step: it saves when `step % N == 0` (None otherwise).

        Preemption (`ddpkit.cluster.preemption`): the state of the last `save` or `load` is remembered.
        When the ranks agree to stop (at `s.step`, here, or at the loader's next batch in a loop that
        calls neither since the last batch), this call, or else the next step boundary ddpkit owns
        (`stop_at_boundary`: the loader's next batch, `s.accumulate`, `s.backward`), saves and raises
        `Preempted` (exit code 75).
        """
        due = self.due(every, state.get("step"))
        retention = keeping.of(keep, keep_every, keep_best, state)
        self._remember(path, retention, state)
        self._saved = True  # this call agrees: the loader's next batch need not
        ctx = self._ctx
        if not (self._preemption.agreed or self._preemption.agree(ctx.distributed, ctx.device, now=due)):
            return self._write(path, retention, background, state) if due else None
        raise self._preempted(self._write(path, retention, False, state), state.get("step"))

    def _write(
        self, path: str | Path, keep: keeping.Retention, background: bool | str, state: dict[str, Any]
    ) -> Path:
        _require_safe_torch()
        mode = writer_mode(background)
        remote = Remote.parse(path)
        root = remote.local if remote is not None else local_path(path)
        if files.is_checkpoint(root):
            raise problem(
                f"{root} is a checkpoint, not a folder of checkpoints",
                f"Save to its parent folder {root.parent}",
            )
        if root.exists() and not root.is_dir():
            raise not_a_root(files.foreign(root) or f"{root} is not a folder")
        self._background.wait()  # the previous save first: one write at a time, in order
        ctx = self._ctx
        if background and ctx.distributed and self._writer_group is None:  # collective: all ranks are here
            self._writer_group = writer_group(self._nice)  # its own (DCP, optimizer shares), lowest priority
        writer = self._writer_process() if mode == "process" else None
        stage = writer.arena.stage if writer is not None else self._background.staging() if mode else None
        snapshot = capture(ctx, {**self._extras(), **state}, copy=mode is not None, stage=stage)
        for name, line in snapshot.notes.items():
            if name not in self._noted:  # once a session: each save keeps it per rank all the same
                self._noted.add(name)
                ctx.say(line)
        if self._record is not None:
            self._record.save(snapshot, step=state.get("step"))
        out = writer.write_file if writer is not None else None
        job = start(
            ctx,
            root,
            snapshot,
            keep,
            group=self._writer_group if mode else None,
            out=out,
            remote=remote,
            process=writer,
        )
        self.last, self.found = files.final_dir(root, job.seq), (str(path), state)  # a rollback target
        if mode is not None:
            self._background.run(lambda: write(ctx, job, snapshot))
            return self.last
        self.last = write(ctx, job, snapshot)
        return self.last

    def _writer_process(self) -> WriterProcess | None:
        """The writer process, its arena reset for a new save (the last write has finished); a new one if
        it died; None where shared memory by file descriptor is missing (not Linux): the thread writes."""
        if self._process is not None and not self._process.alive:
            self._process.close()
            self._process = None
        if self._process is None:
            if not WriterProcess.available():
                if "process" not in self._noted:
                    self._noted.add("process")
                    self._ctx.say('ddpkit: background="process" needs Linux (memfd): a thread writes')
                return None
            self._process = WriterProcess(nice=self._nice)
        self._process.arena.reset()
        return self._process

    # -- preemption: the state last given to save or load, saved at the agreed stop -----------------
    def _remember(self, path: str | Path, keep: keeping.Retention, state: dict[str, Any]) -> None:
        self._remembered = (path, keep, state)  # references only: what they hold when the stop comes
        self._steps_since = 0
        self._preemption.remedy = None  # a signal now sets the flag (the session said what to add before)

    def stepped(self, applied: bool = True) -> None:
        """At every `s.step`, every rank: on an optimizer step (`applied`: the k-th micro-batch) count it,
        and (once there is state to save) agree on a stop. Only there: a group in progress is not saved
        (`Stepper`), and `step` is the optimizer step count (`every=` says so)."""
        if not self._stepping:  # the loader's first boundary agreed moments ago, in this same step
            self._preemption.restart_clock()
        self._stepping = True  # this loop calls s.step: the loader's next batch leaves the agreement to it
        if not applied:
            return
        if self._record is not None:
            self._record.step(self._remembered, self._preemption)
        self._steps_since += 1
        if self._remembered is not None and not self._preemption.agreed:
            self._preemption.agree(self._ctx.distributed, self._ctx.device)

    def stop_at_boundary(self, body: bool | None = None) -> None:
        """At a step boundary ddpkit owns, after the agreed stop: save the remembered state, its `step`
        advanced by the optimizer steps since it was given, and raise `Preempted`.

        The loader's next batch passes `body` (a batch was handed out, and its body ran, since the last
        one). In a loop that never calls `s.step` (the README's first loop, `loss.backward(); opt.step()`,
        saving under `if step % N == 0`), each batch is one optimizer step: unless `s.save` agreed since
        the last batch (it counted its own body's step), the batch's body is counted and the stop is
        agreed here."""
        if body is not None and self._remembered is not None:
            if not (self._stepping or self._saved):
                self._steps_since += body  # the body of the batch before ran (not at a pass's start)
                if not self._preemption.agreed:
                    self._preemption.agree(self._ctx.distributed, self._ctx.device)
            self._saved = False
        if body and self._memory is not None and self._remembered is not None:
            self._snapshot()  # the optimizer, scheduler, counters, RNG and loader all after one step
        if self._record is not None:
            self._record.boundary()
        if not self._preemption.agreed or self._remembered is None:
            return
        path, keep, state = self._remembered
        step = state.get("step")
        if isinstance(step, int) and not isinstance(step, bool):
            state = {**state, "step": step + self._steps_since}
        raise self._preempted(self._write(path, keep, False, state), state.get("step"))

    @staticmethod
    def due(every: Any, step: Any) -> bool:
        """Whether a save with `every=` writes at `step` (always without `every`)."""
        if every is None:
            return True
        if not isinstance(every, int) or every < 1 or not isinstance(step, int):
            raise problem(
                f"every={every!r} needs a whole number of steps, and step= an int (got {step!r})",
                "Pass every=N (N >= 1) together with step=<your optimizer step count>",
            )
        return step % every == 0

    def agree(self, call: str) -> None:
        """Every rank tags `call` in the store before its first collective (`Membership.agree`): a rank
        that reached it alone is refused by name, with where the others stand, in seconds."""
        if self._ctx.group is not None:
            self._ctx.group.agree(call, patient=True, limit=self._ctx.save_timeout)

    def _snapshot(self) -> None:
        """A memory snapshot of the remembered state, its `step` advanced by the optimizer steps since."""
        assert self._memory is not None and self._remembered is not None
        state = self._remembered[2]
        step = state.get("step")
        if isinstance(step, int) and not isinstance(step, bool):
            step += self._steps_since
        self._memory.at_boundary(step, self._ctx.strategy, {**self._extras(), **state})

    def _preempted(self, final: Path, step: Any) -> Preempted:
        self._remembered = None  # saved once: a boundary reached while `Preempted` unwinds saves nothing
        ctx = self._ctx
        return self._preemption.finish(is_main=ctx.is_main, step=step, checkpoint=final, say=ctx.say)

    def wait(self) -> None:
        """Wait for a background save to be committed on every rank; raise its error, if any."""
        self._background.wait()

    def close(self) -> None:
        """At the session's end: finish a background save (its error is raised here), drop the handlers."""
        try:
            self._background.close()  # the write in flight, then its staging memory
        finally:
            if self._process is not None:
                self._process.close()
                self._process = None
            if self._writer_group is not None and dist.is_initialized():
                dist.destroy_process_group(self._writer_group)
            self._writer_group = None
            if self._memory is not None:  # the keeper keeps the snapshots until `ddpkit run` ends
                self._memory.close(drop=False)
                self._memory = None

    def _extras(self) -> dict[str, Any]:
        return {
            n: (o() if callable(o) and not hasattr(o, "state_dict") else o)
            for n, o in self._registered.items()
        }

    # -- export ---------------------------------------------------------------------------------
    def export(self, path: str | Path, model: nn.Module) -> Path | None:
        """Write the full weights of `model` to one plain safetensors file (for inference); every rank calls
        it. Global rank 0 writes. Under FSDP no rank holds the model whole: the file is streamed one
        gathered tensor at a time (`ddpkit.strategy.fsdp_export`). The path on rank 0."""
        ctx = self._ctx
        target, upload = export_target(path)  # a URL: a local file first, uploaded by rank 0
        if ctx.strategy.shards_state and ctx.strategy.owns(model):
            count = ctx.strategy.write_full_state(model, target, ctx.rank)  # collective, tensor by tensor
        else:
            count = self._export_whole(ctx, target, model)
        ctx.barrier()
        ctx.say(f"ddpkit: exported {count} tensors of the full model to {target}")
        if upload is not None and ctx.is_main:
            upload(ctx.say)
        return target if ctx.is_main else None

    def export_to(self, path: str | Path, write: Callable[[Path], Any]) -> Any:
        """`write(local)` (an export: a file or a folder), uploaded by rank 0 when `path` is an fsspec URL."""
        ctx = self._ctx
        return export_via(path, write, is_main=ctx.is_main, barrier=ctx.barrier, say=ctx.say)

    @staticmethod
    def _export_whole(ctx: CheckpointContext, target: Path, model: nn.Module) -> int:
        weights = full_weights(ctx, model)
        if ctx.is_main:
            target.parent.mkdir(parents=True, exist_ok=True)
            tensors = Tensors()
            for key, value in weights.items():
                tensors[key] = files.own_storage(value.detach(), tensors)
            partial = target.with_name(f".{target.name}.tmp")
            files.write_tensors(partial, tensors)
            partial.replace(target)
        return len(weights)

    # -- load -----------------------------------------------------------------------------------
    def load(
        self,
        path: str | Path,
        *,
        strict: bool = True,
        memory: int | bool | str = False,
        buddy: str = "behind",
        **state: Any,
    ) -> dict[str, Any]:
        """Restore the objects passed as keywords from the newest valid checkpoint; return the values.

        Plain keywords (step=0) are defaults for values the checkpoint lacks, and the whole answer on a
        fresh start. `strict` applies to module weights (missing or unexpected keys are errors). The
        objects and the values returned are what a preemption saves until the next `save` or `load`.

        `memory=N` (under `ddpkit run`, whose keeper holds them on each host; `memory=True` is 1): a
        snapshot of the whole state every N optimizer steps, in memory that outlives a killed rank
        (`ddpkit.checkpoint.memory`), taken at the loader's next batch. After a restart the newest step
        every rank holds is restored, unless the newest checkpoint under `path` is newer: a fault costs
        the step in flight, not the steps since the last save. Keep saving to disk (less often) for what
        memory cannot survive: the whole job lost. `memory="auto"`: N chosen from the measured cost of
        the first snapshots, so a snapshot stays under 5% of the steps it covers (said at the start).

        `buddy=` (across hosts, where each host's keeper copies its snapshots to the next host's):
        "behind" (the default) copies behind training, at most one snapshot behind, so a lost host
        recomputes up to two steps; "before-next-step" has the buddy acknowledge step k's snapshot before
        step k+1's first forward (the copy overlaps the next batch's loading), so a lost host recomputes
        at most the step in flight. What the copy cost is said at the end (the wait, the bytes sent).
        """
        self.agree("s.load")
        if buddy not in BUDDY_MODES or (buddy != "behind" and not memory):
            raise problem(
                f"buddy={buddy!r} is not a buddy copy mode here: it takes "
                f"{' or '.join(map(repr, BUDDY_MODES))}, and only with memory snapshots (memory=N)",
                'Pass s.load(..., memory=N, buddy="before-next-step") for a lost host to recompute at most '
                "one step, or leave buddy= out (the copy runs behind training)",
            )
        before, values = self.last, self._load(path, strict, state, memory, buddy)
        self.found = (str(path), state) if self.last is not None and self.last != before else self.found
        self._remember(path, keeping.Retention(), {**state, **{n: values[n] for n in state if n in values}})
        return values

    def _from_memory(
        self, path: str | Path, memory: int | bool | str, state: dict[str, Any], buddy: str = "behind"
    ) -> dict[str, Any] | None:
        """`load(..., memory=N)`: the newest snapshot every rank holds, when newer than the disk's; None:
        the disk decides (every rank agrees which, in one collective)."""
        if self._memory is None:
            self._memory = MemoryRecovery.attach(memory, self._ctx, buddy)
        if self._memory is None:
            return None
        remote = Remote.parse(path)
        return self._memory.restore(
            self._ctx, remote.local if remote is not None else local_path(path), state
        )

    def _load(
        self,
        path: str | Path,
        strict: bool,
        state: dict[str, Any],
        memory: int | bool | str = False,
        buddy: str = "behind",
    ) -> dict[str, Any]:
        _require_safe_torch()
        self._background.wait()
        registered = {n: o for n, o in self._registered.items() if hasattr(o, "state_dict")}
        if (
            memory
            and (restored := self._from_memory(path, memory, {**registered, **state}, buddy)) is not None
        ):
            return restored
        found, values = resuming.restore(self._ctx, path, strict, {**registered, **state})
        self.last = found if found is not None else self.last
        if self._record is not None:
            self._record.write({"event": "load", "checkpoint": found.name if found is not None else None})
        return values


class _Recorder:
    """What one rank saw, for `ddpkit verify --resume-script`: a line per save (digests of everything it
    wrote), per load (the checkpoint taken) and per optimizer step (the generators' digest at the step's
    first boundary, the weights' after it). Only made when the verify tool asks (RECORD_ENV); a run
    without it pays one `is None` test per step. STOP_ENV stops this process at its K-th step, as a
    kill -9 or as a preemption signal would."""

    def __init__(self, path: Path, stop: tuple[str, int] | None) -> None:
        self.path, self.stop = path, stop
        self.steps, self.fresh = 0, True  # optimizer steps taken here; the next boundary starts one
        self.rng = ""

    @classmethod
    def from_env(cls, rank: int) -> _Recorder | None:
        folder = os.environ.get(RECORD_ENV)
        if not folder:
            return None
        how, _, at = os.environ.get(STOP_ENV, "").partition(":")
        stop = (how, int(at)) if how in ("kill", "signal") and at.isdigit() else None
        Path(folder).mkdir(parents=True, exist_ok=True)
        return cls(Path(folder) / f"rank-{rank}.jsonl", stop)

    def write(self, line: dict[str, Any]) -> None:
        with self.path.open("a") as out:
            out.write(json.dumps(line, sort_keys=True) + "\n")

    def boundary(self) -> None:
        if self.fresh:
            self.fresh, self.rng = False, _rng_digest()

    def step(self, remembered: Any, preemption: Preemption) -> None:
        self.steps += 1
        state = remembered[2] if remembered is not None else {}
        modules = {n: m for n, m in state.items() if isinstance(m, nn.Module)}
        weights = {n: _digest(dict(m.state_dict())) for n, m in sorted(modules.items())}
        self.write({"event": "step", "rng": self.rng, "weights": weights})
        self.fresh = True
        if self.stop is not None and self.steps == self.stop[1]:
            if self.stop[0] == "kill":
                os.kill(os.getpid(), signal.SIGKILL)  # as kill -9: nothing after this step is saved
            preemption.asked = preemption.asked or "SIGTERM"  # as the scheduler's signal: agreed, then saved

    def save(self, snapshot: Any, *, step: Any) -> None:
        """The digests of what this save writes: every rank its own part, rank 0 the shared ones."""
        trees = {"rank": snapshot.rank_tree, "shared": snapshot.shared_tree}
        own = trees["rank"].get("values") or {}
        values = {n: _digest(v, snapshot.rank_tensors) for n, v in own.items()}
        parts: dict[str, Any] = {
            "rank": _digest(snapshot.rank_tree, snapshot.rank_tensors),
            "rng": _digest(snapshot.rank_tree.get("rng")),
            "values": values,
        }
        if snapshot.shared_tree is not None:
            parts["weights"] = {n: _digest(dict(t)) for n, t in snapshot.weights.items()}
            shared = snapshot.shared_tree
            parts["objects"] = {n: _digest(v, snapshot.shared_tensors) for n, v in shared["objects"].items()}
            values.update({n: _digest(v, snapshot.shared_tensors) for n, v in shared["values"].items()})
        self.write({"event": "save", "step": step if isinstance(step, int) else None, "digests": parts})
        self.fresh = True


def _digest(tree: Any, tensors: Any = None) -> str:
    """One hash of a JSON tree and the tensors it names (or of a name -> tensor mapping)."""
    h = hashlib.sha256()

    def walk(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            h.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(value, dict):
            for key in sorted(value, key=str):
                h.update(str(key).encode())
                walk(value[key])
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)
        elif isinstance(value, str) and tensors is not None and value in tensors:
            walk(tensors[value])
        else:
            h.update(repr(value).encode())

    walk(tree)
    return h.hexdigest()[:16]


def _rng_digest() -> str:
    """The global generators' state now: torch's (and CUDA's), Python's, numpy's if it is loaded."""
    parts: list[Any] = [torch.get_rng_state(), repr(random.getstate())]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        parts += torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        parts.append(repr(numpy.random.get_state()))
    return _digest(parts)
