"""Data loading that cannot forget the distributed traps.

- Training: `DistributedSampler` in DDP, so every rank sees a different shard of each epoch, and
  `set_epoch` is called each time the loader is iterated anew, so the shuffle changes every epoch.
- Evaluation: `EvalShardSampler` gives rank r the indices r, r+W, r+2W, ... without padding, so a
  metric summed over ranks counts every sample exactly once (DistributedSampler would repeat some).
- `batch_size` is the global batch: per-rank batch = global / (world size x accumulation steps).
- Batches arrive on the session's device; worker processes get seeds distinct per rank and worker.
- Resuming: `ShardedLoader.state_dict()` is the position inside the epoch (epoch, samples consumed
  globally, the loader generator at the start of the pass); `load_state_dict` makes the next pass skip
  the consumed samples in the sampler, so no batch is loaded twice and none is skipped, with or without
  worker processes, also at another world size when the global batch stays the same.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from ddpkit.errors import problem
from ddpkit.names import ELASTIC_BATCH_ENV, ELASTIC_WORLD_ENV


@dataclass(frozen=True)
class BatchPlan:
    """How the global batch splits: global = per_rank x world_size x accumulation."""

    per_rank: int
    world_size: int
    accumulation: int

    @property
    def global_size(self) -> int:
        return self.per_rank * self.world_size * self.accumulation

    def describe(self) -> str:
        return (
            f"global batch {self.global_size} = {self.per_rank} per rank x {self.world_size} "
            f"rank(s) x {self.accumulation} accumulation step(s)"
        )


def plan_batch(
    batch_size: int | None, per_rank_batch_size: int | None, *, world_size: int, accumulation: int = 1
) -> BatchPlan:
    """Resolve the user's batch size (global, or per rank) into a `BatchPlan`, or explain the conflict."""
    if (batch_size is None) == (per_rank_batch_size is None):
        raise problem(
            "give exactly one of batch_size (the global batch) and per_rank_batch_size",
            "Pass batch_size=<global batch> (recommended) or per_rank_batch_size=<batch per rank>",
        )
    if per_rank_batch_size is not None:
        if per_rank_batch_size < 1:
            raise problem(f"per_rank_batch_size={per_rank_batch_size} is below 1", "Pass 1 or more")
        return BatchPlan(per_rank_batch_size, world_size, accumulation)
    assert batch_size is not None
    split = world_size * accumulation
    if batch_size < 1 or batch_size % split:
        nearest = max(split, round(batch_size / split) * split)
        raise problem(
            f"global batch {batch_size} is not divisible by world size {world_size} x "
            f"{accumulation} accumulation step(s) = {split}",
            f"Use a multiple of {split} (e.g. {nearest}), or pass per_rank_batch_size=... instead",
        )
    return BatchPlan(batch_size // split, world_size, accumulation)


def elastic_accumulation(
    accumulation: int, world_size: int, env: Mapping[str, str]
) -> tuple[int, str | None]:
    """The accumulation this world size trains with in an elastic job, and a note when it changed.

    `ddpkit run --nnodes MIN:MAX` runs at any world size up to the most nodes' (ELASTIC_WORLD_ENV). By
    default ("per-rank") a smaller world keeps the per-rank batch, which is what fits a GPU's memory,
    and accumulates more micro-batches, so the global batch stays the user's; with "accumulation" the
    per-rank batch grows instead (`plan_batch` splits the global batch over fewer ranks).
    """
    most = int(env.get(ELASTIC_WORLD_ENV, "0") or 0)
    if most <= world_size or env.get(ELASTIC_BATCH_ENV, "per-rank") != "per-rank":
        return accumulation, None
    if most % world_size:
        raise problem(
            f"the elastic job runs at world size {world_size}, which does not divide its largest world size "
            f"{most}: the per-rank batch cannot be kept with a whole number of accumulation steps",
            "Use node counts whose process counts divide the largest one, or ddpkit run --elastic-batch "
            "accumulation (the per-rank batch grows instead)",
        )
    scaled = accumulation * (most // world_size)
    return scaled, (
        f"elastic: world size {world_size} of up to {most}: {scaled} accumulation step(s) instead of "
        f"{accumulation}, so the per-rank batch and the global batch stay as at {most}"
    )


class EvalShardSampler(Sampler[int]):
    """Rank r of W takes indices r, r+W, ...: no padding, no duplicates, shards may differ by one."""

    def __init__(self, dataset_len: int, *, rank: int, world_size: int) -> None:
        self.indices = range(rank, dataset_len, world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class ResumableSampler(DistributedSampler):
    """A `DistributedSampler` whose next pass can start part-way: it drops `skip` indices, once.

    The order of epoch e is unchanged (a function of seed and e), so skipping indices reproduces the
    rest of an interrupted epoch exactly, without loading the skipped samples.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.skip = 0

    def __iter__(self) -> Iterator[int]:
        skip, self.skip = self.skip, 0
        return itertools.islice(super().__iter__(), skip, None)


def seed_worker(worker_id: int) -> None:
    """DataLoader worker init: numpy and `random` follow torch's per-worker seed (distinct per rank)."""
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


def to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Move every tensor inside nested tuples, lists and dicts to `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, Mapping):
        return type(batch)({k: to_device(v, device, non_blocking) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(to_device(v, device, non_blocking) for v in batch))
    if isinstance(batch, Sequence) and not isinstance(batch, str):
        return type(batch)(to_device(v, device, non_blocking) for v in batch)
    return batch


class ShardedLoader:
    """A DataLoader that sets the sampler's epoch on every new pass and yields batches on `device`.

    It also knows its position for checkpoints: `state_dict()` / `load_state_dict()`.
    """

    def __init__(self, loader: DataLoader, *, device: torch.device, batch: BatchPlan) -> None:
        self.loader = loader
        self.device = device
        self.batch = batch
        self.epoch = 0
        self._skip = 0  # per-rank samples the next pass skips (set by load_state_dict)
        self._pass: dict[str, Any] | None = None  # the pass in progress: epoch, position, generator

    @property
    def sampler(self) -> Sampler:
        return self.loader.sampler

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch of the next pass (for resuming); passes count up from there."""
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        generator = self.loader.generator
        self._pass = {
            "epoch": self.epoch,
            "per_rank_samples": self._skip,
            "generator": generator.get_state() if generator is not None else None,
        }
        if isinstance(self.sampler, DistributedSampler):
            self.sampler.set_epoch(self.epoch)
        if isinstance(self.sampler, ResumableSampler):
            self.sampler.skip = self._skip
        self._skip = 0
        self.epoch += 1
        non_blocking = self.device.type == "cuda" and self.loader.pin_memory
        for batch in self.loader:
            self._pass["per_rank_samples"] += self.batch.per_rank
            yield to_device(batch, self.device, non_blocking)
        self._pass = None

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The position: the epoch of the current (or next) pass and the samples it has consumed.

        `samples` counts over all ranks (per-rank samples x world size), so it keeps its meaning at
        another world size. `global_batch` is the true global batch (per rank x world x accumulation),
        so trading accumulation for ranks keeps it. `generator` (this rank's loader generator at the
        start of the pass) makes worker seeds repeat; it is per rank.
        """
        world = self.batch.world_size
        if self._pass is not None:
            current = self._pass
            epoch, per_rank, gen = current["epoch"], current["per_rank_samples"], current["generator"]
        else:
            generator = self.loader.generator
            epoch, per_rank = self.epoch, self._skip
            gen = generator.get_state() if generator is not None else None
        return {
            "epoch": epoch,
            "samples": per_rank * world,
            "world_size": world,
            "per_rank_batch": self.batch.per_rank,
            "accumulation": self.batch.accumulation,
            "global_batch": self.batch.global_size,
            "generator": gen,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Make the next pass continue epoch `state["epoch"]` after `state["samples"]` samples.

        A `generator` of None (a rank that did not exist when the state was saved) keeps this
        rank's own generator.
        """
        world, samples = self.batch.world_size, int(state["samples"])
        if samples % world:
            raise problem(
                f"the saved data position ({samples} samples into epoch {state['epoch']}) cannot be split "
                f"over world size {world}",
                f"Resume with a world size that divides {samples}, or at the start of an epoch",
            )
        if samples and not isinstance(self.sampler, ResumableSampler):
            raise problem(
                "this loader cannot start part-way into an epoch (it was not built by ddpkit's training "
                "loader)",
                "Build it with session.loader(dataset, batch_size=...) without evaluation=True",
            )
        self.epoch = int(state["epoch"])
        self._skip = samples // world
        self._pass = None
        if state.get("generator") is not None and self.loader.generator is not None:
            self.loader.generator.set_state(state["generator"])


def make_loader(
    dataset: Dataset,
    batch: BatchPlan,
    *,
    rank: int,
    device: torch.device,
    seed: int,
    shuffle: bool = False,
    drop_last: bool = False,
    evaluation: bool = False,
    **dataloader_kwargs: Any,
) -> ShardedLoader:
    """Build the sharded loader; see the module docstring for the sampling rules."""
    world = batch.world_size
    if "sampler" in dataloader_kwargs or "batch_sampler" in dataloader_kwargs:
        raise problem(
            "ddpkit's loader chooses the sampler itself (it must shard by rank)",
            "Drop sampler=/batch_sampler=, or build your own DataLoader and use session.device",
        )
    size = len(dataset)  # type: ignore[arg-type]
    if size < world:
        raise problem(
            f"the data set has {size} sample(s), fewer than the world size {world}: "
            "some ranks would get none",
            f"Use at least {world} samples or fewer processes (--nproc {max(1, size)})",
        )
    sampler: Sampler | None
    if evaluation:
        sampler = EvalShardSampler(size, rank=rank, world_size=world) if world > 1 else None
    else:
        # Also at world size 1: the order of epoch e is then a pure function of (seed, e), the same
        # global order at every world size, which is what exact resume and `verify` rely on.
        sampler = ResumableSampler(
            dataset, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
    generator = torch.Generator().manual_seed(seed + 7919 * (rank + 1))
    loader = DataLoader(
        dataset,
        batch_size=batch.per_rank,
        sampler=sampler,
        drop_last=drop_last and not evaluation,
        generator=generator,
        worker_init_fn=dataloader_kwargs.pop("worker_init_fn", seed_worker),
        pin_memory=dataloader_kwargs.pop("pin_memory", device.type == "cuda"),
        **dataloader_kwargs,
    )
    return ShardedLoader(loader, device=device, batch=batch)
