"""`ddpkit.fit`'s side of `micro_batch="auto"`: each loader micro-batch run as the agreed number of
parts, and an optimizer step that ran out of memory on any rank re-run from its first micro-batch.

    blocks = SplitBlocks(s, model, optimizer, max_norm, forward_backward)
    loss, micro = blocks.run(batch)     # 1..P `s.accumulate` blocks; on micro.sync fit takes the step

Why here and not in the stepper: only the loop holds the step's batches, so only it can run them again.
The batches of the step in progress are kept (references, no copies) until the step is taken. On
`ddpkit.step.oom.StepOutOfMemory` (raised on every rank in the same block) the step is dropped on every
rank (`Stepper.drop_step`: gradients set to None, the group restarted; the optimizer has not stepped),
the parts double (the accumulation with them: the global batch and the update stay the same), one line
says so and one per rank that ran out says where its memory was (parameters, gradients, optimizer
state, the micro-batch's own share, the failed allocation: `ddpkit.step.oom.describe_where`), the
trackers get the new micro-batch and those figures (`oom/*_mib`), on CUDA each rank that ran out writes
torch's memory snapshot next to the run's logs (`log_dir`), and the step's batches run again, split.
A micro-batch of n samples in P parts: pieces of n/P, each loss weighted by its share (1.0 for equal
pieces), so a mean loss's gradient is the whole micro-batch's (`ddpkit.step.micro_batches.split`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ddpkit import names
from ddpkit.observe import tracking
from ddpkit.step import micro_batches, oom
from ddpkit.step.stepping import MicroBatch
from ddpkit.training import oom_ahead

if TYPE_CHECKING:
    from ddpkit.training.session import Session

ForwardBackward = Callable[[Any, float], torch.Tensor]  # (batch, loss weight) -> the unweighted loss
TrainStep = Callable[[torch.nn.Module, Any], torch.Tensor]  # fit's train_step(model, batch) -> loss


HISTORY_ENV = names.CUDA_MEMORY_HISTORY_ENV  # "0": no allocation history on CUDA ranks under the opt-in


def record_history(device: torch.device) -> bool:
    """On CUDA (under `micro_batch="auto"`): torch's allocator records its last 100,000 allocations and
    frees with their Python stacks, so the snapshot written at an out-of-memory error shows what held
    the memory and where it was allocated (PyTorch's "Understanding CUDA memory usage"; open the file
    at pytorch.org/memory_viz). It costs a stack capture per allocation; DDPKIT_CUDA_MEMORY_HISTORY=0
    turns it off. Not exercised on a CPU machine."""
    if device.type != "cuda" or os.environ.get(HISTORY_ENV, "1") == "0":
        return False
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    return True


def dump_snapshot(directory: str, rank: int, step: int) -> str:
    """torch's CUDA memory snapshot (segments, blocks, the recorded history up to the failure) as
    `memory-snapshot-rank{rank}-step{step}.pickle` in `directory`; its path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"memory-snapshot-rank{rank}-step{step}.pickle")
    torch.cuda.memory._dump_snapshot(path)
    return path


class SplitBlocks:
    """One loader micro-batch as `s.accumulate` blocks; the step's batches re-run after an agreed OOM."""

    def __init__(
        self,
        s: Session,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        max_norm: float | None,
        forward_backward: ForwardBackward,
        train_step: TrainStep | None = None,
    ) -> None:
        self.s, self.model, self.optimizer, self.max_norm = s, model, optimizer, max_norm
        self.forward_backward = forward_backward
        self.train_step = train_step  # FSDP: the loss the split chosen ahead is estimated with
        self.auto: oom.AutoMicroBatch | None = s.stepper.oom
        self.group: list[Any] = []  # the batches of the optimizer step in progress
        self.history = False  # CUDA: the allocator's history recorded, for the snapshot at an OOM
        if self.auto is not None:
            self.auto.watch(model, optimizer)  # its model state is counted in an OOM's breakdown
            self.history = record_history(s.device)

    def run(self, batch: Any) -> tuple[torch.Tensor, MicroBatch]:
        """Forward and backward of one loader micro-batch (its parts); the loss is the micro-batch's."""
        if self.auto is None:
            return self._blocks(batch)
        if self.auto.ahead and not self.auto.estimate and self.train_step is not None:
            oom_ahead.choose(self.s, self.model, self.optimizer, self.train_step, batch)  # once per run
        self.group.append(batch)
        todo = [batch]
        while True:
            try:
                for j, b in enumerate(todo):
                    loss, micro = self._blocks(b)
                    if j < len(todo) - 1:  # an earlier batch of the step, run again: fit steps after the last
                        self.s.step(self.optimizer, max_norm=self.max_norm)
                if micro.sync:
                    self.group = []
                return loss, micro
            except oom.StepOutOfMemory as exc:
                ranks, where = exc.ranks, exc.where
            self._split(ranks, where)  # outside the except: the failed step's frames are gone
            todo = list(self.group)

    def _blocks(self, batch: Any) -> tuple[torch.Tensor, MicroBatch]:
        s = self.s
        parts = 1 if self.auto is None else self.auto.parts
        total: torch.Tensor | None = None
        last: MicroBatch | None = None
        pieces = micro_batches.split(batch, parts)
        for i, (piece, weight) in enumerate(pieces):
            with (
                s.accumulate(self.model) as micro,
                oom.naming(micro_batches.batch_len(batch), s.rank, self.auto),
            ):
                loss = self.forward_backward(piece, weight)
            last = micro
            part = loss.detach() * (weight / parts) if parts > 1 else loss
            total = part if total is None else total + part
            if i < len(pieces) - 1:
                s.step(self.optimizer, max_norm=self.max_norm)  # not the step's last block: no update
        assert total is not None and last is not None
        return total, last

    def _split(self, ranks: list[int], where: dict[int, dict[str, int]]) -> None:
        s, auto = self.s, self.auto
        assert auto is not None
        n = micro_batches.batch_len(self.group[0])
        snapshot = None
        if self.history and s.rank in ranks:  # before the cache is emptied: the OOM's own picture
            root = s.tracking.log_dir or tracking.default_dir(os.environ)
            snapshot = dump_snapshot(root, s.rank, s.stepper.steps + 1)
        auto.split_more(s.stepper.steps + 1)
        s.stepper.drop_step(self.optimizer)
        if s.device.type == "cuda":  # the failed step's blocks, cached: handed back before the re-run
            torch.cuda.empty_cache()
        s.print(
            f"ddpkit: out of memory on rank(s) {ranks} in optimizer step {s.stepper.steps + 1} at "
            f"micro-batch {n * 2 / auto.parts:g} per rank: the step was dropped on every rank (no update "
            f"applied) and runs again as micro-batches of {n / auto.parts:g} (accumulation "
            f"{s.stepper.blocks // 2} -> {s.stepper.blocks}; global batch "
            f"{n * s.accumulation * s.world_size} unchanged)"
        )
        for r in ranks:  # where the memory went on each rank that ran out, in the plan's categories
            s.print(f"ddpkit: {oom.describe_where(r, where.get(r, {}), s.device.type)}")
        if snapshot is not None:
            print(
                f"ddpkit: rank {s.rank}'s CUDA memory snapshot at the failure: {snapshot} "
                "(open it at https://pytorch.org/memory_viz)",
                flush=True,
            )
        first = where.get(ranks[0], {})
        s.log(
            {
                "micro_batch/size": n / auto.parts,
                "micro_batch/parts": auto.parts,
                **{f"oom/{k}_mib": v / (1 << 20) for k, v in first.items()},
            },
            step=s.stepper.steps,
        )
