"""Back to the last checkpoint under `ddpkit.fit`: after a spike (its data left out), after a replica drift.

    rollback = Rollback(s, loader)               # fit, when the session's guard rolls back
    rollback.mark()                              # after each micro-batch is read: where its samples lie
    undone = rollback.to_checkpoint(spike, needed)   # at a rollback spike, on every rank (it is agreed)
    rollback.clear()                             # after each optimizer step
    undone = rollback.to_agreed(drift, needed)   # fit(on_drift="rollback"): a `ReplicaDrift`, every rank

The samples are positions in the epoch's global order (every rank's share of the batch), so the skip
holds at another world size and in every later checkpoint (the loader's `skipped`); the replay from the
checkpoint is the same computation as before, so a relaunch decides the same. `fit` keeps its own
counters: it applies the `Undone` it is handed (steps and passes to take back).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ddpkit.data import ShardedLoader
from ddpkit.errors import problem
from ddpkit.step.fingerprint import ReplicaDrift, ReplicaFingerprints
from ddpkit.step.spikes import Spike
from ddpkit.training.session import Session

MAX_REPEATS = 3  # rollbacks in a row that spike at the same step before the run stops (not the data)
MAX_DRIFTS = 3  # drifts rolled back in one fit call before the run stops (a device that keeps failing)


@dataclass(frozen=True)
class Undone:
    """What a rollback took back: optimizer steps, and passes over the data (the checkpoint lies `passes`
    epochs before the pass that spiked)."""

    steps: int
    passes: int


class Rollback:
    """The spiking step's samples and the way back to the session's last checkpoint, for one `fit` call."""

    def __init__(self, s: Session, loader: ShardedLoader) -> None:
        self.s, self.loader = s, loader
        self.step_samples: list[tuple[int, int, int]] = []  # (epoch, start, stop) of the step's micro-batches
        self.repeats = (0, 0)  # (optimizer step, rollbacks in a row that spiked at it)
        self.drifts: list[int] = []  # the optimizer steps at which a replica drift was rolled back

    def mark(self) -> None:
        """The micro-batch just read: where its samples lie in the epoch's global order."""
        s = self.s
        epoch, end = self.loader.position
        self.step_samples.append((epoch, end - self.loader.batch.per_rank * s.world_size, end))

    def clear(self) -> None:
        """An optimizer step ended: the next one's samples start here."""
        self.step_samples = []

    def to_checkpoint(self, spike: Spike, needed: Mapping[str, object]) -> Undone | None:
        """Every rank (the spike is agreed): leave this step's samples out of the loader's passes, load the
        session's last checkpoint (which must hold every object of `needed`) and say so. None: there is
        none (the step stays skipped, its samples listed as left out)."""
        s, loader = self.s, self.loader
        ranges = _merged(self.step_samples)
        said = ", ".join(f"[{a}, {b}) of epoch {e}" for e, a, b in ranges)
        target = s.last_checkpoint
        if target is None:
            for r in ranges:
                loader.skip_samples(*r)
            s.print(
                f"ddpkit: no checkpoint saved or loaded yet in this session, so nothing to roll back "
                f"to: the step was skipped instead; global samples {said} are listed as left out"
            )
            return None
        root, objects = target
        missing = _missing(needed, objects)
        if missing:
            raise problem(
                f"SpikeGuard(remedy='rollback') cannot roll back to the last checkpoint in {root}: it was "
                f"given no {', '.join(missing)} (the objects ddpkit.fit trains with), so loading it would "
                "leave them where the spike put them",
                f"Pass {', '.join(f'{n}=...' for n in missing)} to s.save (stepper=s.stepper, loader=the "
                "training loader), or use remedy='skip'",
            )
        step, times = self.repeats
        self.repeats = (spike.step, times + 1 if step == spike.step else 1)
        if self.repeats[1] > MAX_REPEATS:
            raise problem(
                f"optimizer step {spike.step} spiked again after {MAX_REPEATS} rollbacks, each leaving out "
                "the samples of the step that spiked: the cause is not in the data (every rank stopped here)",
                "Lower the learning rate or clip gradients (max_norm=...), raise SpikeGuard(threshold=...), "
                "or use SpikeGuard(remedy='skip')",
            )
        judge = s.stepper.spikes
        assert judge is not None
        done = s.stepper.steps - spike.counted  # before this step

        def leave_out() -> None:
            for r in ranges:
                loader.skip_samples(*r)

        undone = self._load(root, objects, done, leave_out)
        judge.rolled_back()
        s.print(
            f"ddpkit: rolled back every rank to the last checkpoint in {root} (optimizer step "
            f"{s.stepper.steps}, {undone.steps} step(s) undone); global samples {said} are left out from "
            "now on (listed as the loader's `skipped` in later checkpoints)"
        )
        s.log({"spike/rolled_back": float(undone.steps)}, step=spike.step)
        return undone

    def to_agreed(self, drift: ReplicaDrift, needed: Mapping[str, object]) -> Undone:
        """Every rank (a drift is seen by all at the same step): load the session's last checkpoint, which
        was written while the replicas agreed (a save compares them first, `Session.save`), compare the
        replicas again on it, and say so. The replay is the same computation as before the drift, so a
        transient fault (one flipped bit) leaves no trace: the run ends where it would have ended. Raises
        the drift, with the reason, where rolling back cannot help or cannot be done."""
        s = self.s
        target = s.last_checkpoint
        if target is None:
            raise not_rolled_back(
                drift,
                "no checkpoint was saved or loaded in this session. Save checkpoints during the run (a "
                "callback calling s.save(root, model=, optimizer=, stepper=s.stepper, loader=)) so that a "
                "drift rolls back to the last one",
            )
        root, objects = target
        missing = _missing(needed, objects)
        why = ""
        if missing:
            why = (
                f"the last checkpoint in {root} holds no {', '.join(missing)}, so loading it would leave "
                f"them as the drift left them. Pass {', '.join(f'{n}=...' for n in missing)} to s.save "
                "(stepper=s.stepper, loader=the training loader)"
            )
        elif drift.step in self.drifts:
            why = (
                f"the replay from the checkpoint drifted again at optimizer step {drift.step}: the cause is "
                "in the computation (a rank-dependent operation or a non-deterministic kernel), not a "
                "transient fault. Run `ddpkit verify --locate` on the model to find the operation"
            )
        elif len(self.drifts) >= MAX_DRIFTS:
            why = (
                f"the replicas drifted {len(self.drifts) + 1} times in this run (at optimizer steps "
                f"{[*self.drifts, drift.step]}): a device keeps computing wrongly. Take the node of the "
                "rank(s) named out of the job, then resume from the last checkpoint"
            )
        if why:
            raise not_rolled_back(drift, why)
        self.drifts.append(drift.step)
        undone = self._load(root, objects, s.stepper.steps, lambda: None)
        model, optimizer = needed["model"], needed["optimizer"]
        prints = s.stepper.fingerprints
        if (
            prints is not None
            and isinstance(model, nn.Module)
            and isinstance(optimizer, torch.optim.Optimizer)
        ):
            replicated = optimizer if s.stepper.sharded_step(optimizer) is None else None
            prints.check(s.stepper.steps, model, replicated)  # the checkpoint's replicas agree (or raise)
        odd = f"rank(s) {', '.join(map(str, drift.ranks))} differed" if drift.ranks else "no majority"
        s.print(
            f"ddpkit: the replicas drifted at optimizer step {drift.step} (first in {drift.tensor}; {odd}; "
            f"the last agreement at step {drift.last_agreed}): rolled back every rank to the last "
            f"checkpoint in {root} (optimizer step {s.stepper.steps}, written while they agreed; "
            f"{undone.steps} step(s) undone), the replicas compared equal again at step "
            f"{_agreed_at(prints)}, training goes on"
        )
        s.log({"drift/rolled_back": float(undone.steps)}, step=drift.step)
        return undone

    def _load(
        self, root: str, objects: Mapping[str, object], done: int, after: Callable[[], object]
    ) -> Undone:
        """Load the checkpoint into the objects it was saved from (every rank); `after` runs once it is
        loaded. The steps and passes over the data it took back, from `done` steps and this pass."""
        s, loader = self.s, self.loader
        pass_epoch = loader.position[0]
        s.load(root, **objects)
        after()
        back = max(0, pass_epoch - loader.epoch)  # the checkpoint lies `back` passes before this one
        return Undone(max(0, done - s.stepper.steps), back)


def not_rolled_back(drift: ReplicaDrift, why: str) -> ReplicaDrift:
    """The drift raised again (every rank, the same fields), its message saying why fit did not roll back."""
    return ReplicaDrift(
        f"{str(drift).rstrip('.')}. ddpkit.fit did not roll back: {why}",
        step=drift.step,
        last_agreed=drift.last_agreed,
        ranks=drift.ranks,
        tensor=drift.tensor,
    )


def _agreed_at(prints: ReplicaFingerprints | None) -> str:
    """The last step at which the fingerprints saw the replicas agree, for a report."""
    agreed = None if prints is None else prints.last_agreed
    return "?" if agreed is None else str(agreed)


def _missing(needed: Mapping[str, object], objects: Mapping[str, object]) -> list[str]:
    """The objects fit trains with that a checkpoint was not saved from (by identity)."""
    return [n for n, o in needed.items() if not any(v is o for v in objects.values())]


def _merged(parts: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Adjacent (epoch, start, stop) ranges joined: one step's micro-batches, one range per epoch."""
    out: list[tuple[int, int, int]] = []
    for e, a, b in parts:
        if out and out[-1][0] == e and out[-1][2] == a:
            out[-1] = (e, out[-1][1], b)
        else:
            out.append((e, a, b))
    return out
