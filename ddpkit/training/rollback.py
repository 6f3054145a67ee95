"""SpikeGuard(remedy="rollback") under `ddpkit.fit`: back to the last checkpoint, the spike's data left out.

    rollback = Rollback(s, loader)               # fit, when the session's guard rolls back
    rollback.mark()                              # after each micro-batch is read: where its samples lie
    undone = rollback.to_checkpoint(spike, needed)   # at a rollback spike, on every rank (it is agreed)
    rollback.clear()                             # after each optimizer step

The samples are positions in the epoch's global order (every rank's share of the batch), so the skip
holds at another world size and in every later checkpoint (the loader's `skipped`); the replay from the
checkpoint is the same computation as before, so a relaunch decides the same. `fit` keeps its own
counters: it applies the `Undone` it is handed (steps and passes to take back).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ddpkit.data import ShardedLoader
from ddpkit.errors import problem
from ddpkit.step.spikes import Spike
from ddpkit.training.session import Session

MAX_REPEATS = 3  # rollbacks in a row that spike at the same step before the run stops (not the data)


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
        missing = [n for n, o in needed.items() if not any(v is o for v in objects.values())]
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
        done, pass_epoch = s.stepper.steps - spike.counted, loader.position[0]  # before this step
        s.load(root, **objects)
        for r in ranges:
            loader.skip_samples(*r)
        judge.rolled_back()
        undone = max(0, done - s.stepper.steps)
        back = max(0, pass_epoch - loader.epoch)  # the checkpoint lies `back` passes before this one
        s.print(
            f"ddpkit: rolled back every rank to the last checkpoint in {root} (optimizer step "
            f"{s.stepper.steps}, {undone} step(s) undone); global samples {said} are left out from "
            "now on (listed as the loader's `skipped` in later checkpoints)"
        )
        s.log({"spike/rolled_back": float(undone)}, step=spike.step)
        return Undone(undone, back)


def _merged(parts: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Adjacent (epoch, start, stop) ranges joined: one step's micro-batches, one range per epoch."""
    out: list[tuple[int, int, int]] = []
    for e, a, b in parts:
        if out and out[-1][0] == e and out[-1][2] == a:
            out[-1] = (e, out[-1][1], b)
        else:
            out.append((e, a, b))
    return out
