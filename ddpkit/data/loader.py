"""The loader `s.loader` returns: one pass per epoch, batches on the device, a position for checkpoints.

What each kind of source gets (`ddpkit.data.sources` tells them apart):

- map-style, training: `ResumableSampler` (a DistributedSampler, also at world size 1, so the global
  order of epoch e is a function of (seed, e) only), `set_epoch` on every new pass.
- map-style, evaluation: `EvalShardSampler`, every sample once, no padding.
- iterable: `StreamSplit` (ddpkit.data.streams) rebuilt for every pass with its epoch and start.
- pre-split (this rank's own part): its own order, every rank's pass ended at the shortest rank's.

Worker processes get seeds distinct per rank and worker; the loader's generator is saved with the
position so they repeat on resume.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, Sampler
from torch.utils.data import default_collate as torch_collate

from ddpkit.data.batching import BatchPlan
from ddpkit.data.position import resume_point
from ddpkit.data.samplers import (
    EvalShardSampler,
    OwnPartSampler,
    ResumableSampler,
    SharedBatchSampler,
    SharedOrderSampler,
)
from ddpkit.data.sources import Iterated, check_stream_options, is_hf_iterable, kind_of
from ddpkit.data.streams import StreamSplit, as_is, equalised
from ddpkit.errors import problem


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
        mapping: Any = type(batch)  # the batch's own mapping type (dict, OrderedDict, a BatchEncoding, ...)
        return mapping({k: to_device(v, device, non_blocking) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(to_device(v, device, non_blocking) for v in batch))
    if isinstance(batch, Sequence) and not isinstance(batch, str):
        sequence: Any = type(batch)  # list, or the batch's own sequence type
        return sequence(to_device(v, device, non_blocking) for v in batch)
    return batch


_END = object()  # the end of a pass (a batch may be anything, None included)


class ShardedLoader:
    """A DataLoader that sets the sampler's epoch on every new pass and yields batches on `device`.

    It also knows its position for checkpoints: `state_dict()` / `load_state_dict()`. `kind` is the
    source's ('map', 'stream' or 'presplit'); `make_pass(epoch, skip)` builds a stream's DataLoader.
    """

    def __init__(
        self,
        loader: DataLoader,
        *,
        device: torch.device,
        batch: BatchPlan,
        kind: str = "map",
        make_pass: Callable[[int, int], DataLoader] | None = None,
        equalise: bool = False,
        boundary: Callable[[bool], None] | None = None,
    ) -> None:
        self.loader = loader
        self.device = device
        self.batch = batch
        self.kind = kind
        self.epoch = 0
        self.note: str | None = None  # what the last load_state_dict did to the position, if not plain
        self._make_pass = make_pass
        self._equalise = equalise
        self._generator = loader.generator
        self._skip = 0  # global samples the next pass skips (set by load_state_dict)
        self._pass: dict[str, Any] | None = None  # the pass in progress: epoch, position, generator
        self._skips: list[tuple[int, int, int]] = []  # (epoch, start, stop): global samples left out
        # the session's, called before each batch is read: True when a batch's body ran since the last call
        self.boundary = boundary

    @property
    def sampler(self) -> Sampler | None:
        """The map-style sampler; None for an iterable source (torch's placeholder is no sampler)."""
        return None if isinstance(self.loader.dataset, IterableDataset) else self.loader.sampler  # type: ignore[return-value]

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch of the next pass (for resuming); passes count up from there."""
        self.epoch = epoch

    def __len__(self) -> int:
        if self.sampler is None:
            raise TypeError("an iterable source has no length before it is read (ddpkit loader)")
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        world = self.batch.world_size
        generator = self._generator
        epoch = self.epoch
        position = self._past_skips(epoch, self._skip)  # global samples of the epoch's order
        start_state = generator.get_state() if generator is not None else None
        self._pass = {"epoch": epoch, "per_rank_samples": position // world, "generator": start_state}
        batches = self._open(epoch, position)
        self._skip = 0
        self.epoch += 1
        non_blocking = self.device.type == "cuda" and self.loader.pin_memory
        step = self.batch.per_rank * world
        body = False  # a batch was handed out (and its body ran) since the last boundary
        while True:
            if self.boundary is not None:  # the loop's body is done: a preemption is agreed and saved here
                self.boundary(body)
            jumped = self._past_skips(epoch, position)
            if jumped != position:  # a skipped range starts here: reopen the pass after it
                if generator is not None and start_state is not None:
                    generator.set_state(start_state)  # the same worker seeds as a resume from `jumped`
                position = jumped
                self._pass["per_rank_samples"] = position // world
                batches = self._open(epoch, position)
            batch = next(batches, _END)
            if batch is _END:
                break
            self._pass["per_rank_samples"] += self.batch.per_rank
            position += step
            body = True
            yield to_device(batch, self.device, non_blocking)
        self._pass = None

    def _open(self, epoch: int, skip: int) -> Iterator[Any]:
        """The batches of `epoch` from global sample `skip` on (the sampler's or the stream's own skip)."""
        world = self.batch.world_size
        if self._make_pass is not None:
            self.loader = self._make_pass(epoch, skip)
        if isinstance(self.sampler, (DistributedSampler, OwnPartSampler, SharedOrderSampler)):
            self.sampler.set_epoch(epoch)
        if isinstance(self.sampler, (ResumableSampler, OwnPartSampler)):
            self.sampler.skip = skip // world
        if isinstance(self.sampler, SharedOrderSampler):
            self.sampler.skip = skip  # a position in the global order
        if isinstance(self.loader.batch_sampler, SharedBatchSampler):  # counted in global micro-batches
            self.loader.batch_sampler.set_epoch(epoch)
            self.loader.batch_sampler.skip = skip // (world * self.batch.per_rank)
        if self.kind == "presplit" and self.sampler is None:  # an iterable's own part: re-read, skip
            dataset: Any = self.loader.dataset
            if callable(getattr(dataset, "set_epoch", None)):
                dataset.set_epoch(epoch)
            batches: Any = itertools.islice(self.loader, skip // world // self.batch.per_rank, None)
        else:
            batches = iter(self.loader)
        if self._equalise:
            batches = equalised(batches, self.device)
        return iter(batches)

    # -- samples left out (the spike guard's rollback, `ddpkit.step.spikes`) --------------------------
    @property
    def position(self) -> tuple[int, int]:
        """(epoch, global samples consumed) of the pass in progress, or where the next pass starts."""
        state = self.state_dict()
        return int(state["epoch"]), int(state["samples"])

    def skip_samples(self, epoch: int, start: int, stop: int) -> None:
        """Leave global samples [start, stop) of `epoch`'s order out of every later pass over them.

        Positions count over all ranks in the epoch's global order (as the saved position does), so the
        skip holds at another world size and across a resume: the list is part of `state_dict()`. A pass
        that reaches `start` reopens at `stop` through the sampler's (or stream's) own skip, the way a
        resume does; the batches after the range are the ones the run would have read anyway."""
        if not 0 <= start < stop:
            raise problem(
                f"cannot skip samples [{start}, {stop}) of epoch {epoch}: an empty or negative range",
                "Pass 0 <= start < stop",
            )
        self._skips = sorted({*self._skips, (int(epoch), int(start), int(stop))})

    @property
    def skipped(self) -> list[tuple[int, int, int]]:
        """The ranges left out, as (epoch, first global sample, end), in order."""
        return list(self._skips)

    def _past_skips(self, epoch: int, position: int) -> int:
        """`position`, moved past every skipped range of `epoch` that it falls in."""
        moved, before = True, position
        while moved:
            moved = False
            for e, start, stop in self._skips:
                if e == epoch and start <= position < stop:
                    position, moved = stop, True
        if position != before and position % self.batch.world_size and self.kind == "map":
            raise problem(
                f"a skipped range of epoch {epoch} ends at global sample {position}, which world size "
                f"{self.batch.world_size} cannot split",
                "Resume at a world size that divides the skipped ranges' ends (the one they were recorded "
                "at does), or drop the range",
            )
        return position

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The position: the epoch of the current (or next) pass and the samples it has consumed.

        `samples` counts over all ranks (per-rank samples x world size), so it keeps its meaning at
        another world size. `global_batch` is the true global batch (per rank x world x accumulation),
        so trading accumulation for ranks keeps it. `generator` (this rank's loader generator at the
        start of the pass) makes worker seeds repeat; it is per rank. `kind` is the source's
        (`ddpkit.data.position` says what each kind does at another world size). `skipped` (when any):
        the global sample ranges left out, `[epoch, start, stop]` each (`skip_samples`).
        """
        world = self.batch.world_size
        if self._pass is not None:
            current = self._pass
            epoch, samples, gen = current["epoch"], current["per_rank_samples"] * world, current["generator"]
        else:
            generator = self._generator
            epoch, samples = self.epoch, self._skip
            gen = generator.get_state() if generator is not None else None
        state = {
            "epoch": epoch,
            "samples": samples,
            "world_size": world,
            "per_rank_batch": self.batch.per_rank,
            "accumulation": self.batch.accumulation,
            "global_batch": self.batch.global_size,
            "generator": gen,
            "kind": self.kind,
        }
        if self._skips:  # the samples a spike's rollback left out, listed in the checkpoint
            state["skipped"] = [list(r) for r in self._skips]
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Make the next pass continue epoch `state["epoch"]` after `state["samples"]` samples.

        A `generator` of None (a rank that did not exist when the state was saved) keeps this
        rank's own generator.
        """
        epoch, samples, self.note = resume_point(self.kind, state, self.batch.world_size)
        if samples and self.kind == "map" and not isinstance(self.sampler, ResumableSampler):
            raise problem(
                "this loader cannot start part-way into an epoch (it was not built by ddpkit's training "
                "loader)",
                "Build it with session.loader(dataset, batch_size=...) without evaluation=True",
            )
        self.epoch = epoch
        self._skip = samples
        self._pass = None
        # a skip, once decided, holds: a rollback loads a checkpoint older than the ranges it adds
        saved = ((int(e), int(a), int(b)) for e, a, b in state.get("skipped", ()))
        self._skips = sorted({*self._skips, *saved})
        if state.get("generator") is not None and self._generator is not None:
            self._generator.set_state(state["generator"])


def make_loader(
    dataset: Any,
    batch: BatchPlan,
    *,
    rank: int,
    device: torch.device,
    seed: int,
    shuffle: bool = False,
    drop_last: bool = False,
    evaluation: bool = False,
    presplit: bool = False,
    shuffle_buffer: int = 10_000,
    boundary: Callable[[bool], None] | None = None,
    **dataloader_kwargs: Any,
) -> ShardedLoader:
    """Build the sharded loader; see the module docstring for the sampling rules. `boundary`: called
    before each batch is read (the session's: where a preemption's stop is agreed and saved)."""
    world = batch.world_size
    kind = kind_of(dataset, presplit=presplit)
    generator = torch.Generator().manual_seed(seed + 7919 * (rank + 1))
    options = dict(
        generator=generator,
        worker_init_fn=dataloader_kwargs.pop("worker_init_fn", seed_worker),
        pin_memory=dataloader_kwargs.pop("pin_memory", device.type == "cuda"),
        **dataloader_kwargs,
    )
    if kind in ("stream", "hf") or (kind == "presplit" and not hasattr(dataset, "__getitem__")):
        check_stream_options(kind, options)
    if kind == "stream":
        collate = options.pop("collate_fn", None) or torch_collate

        def make_pass(epoch: int, skip: int) -> DataLoader:
            split = StreamSplit(
                dataset,
                rank=rank,
                world=world,
                per_rank=batch.per_rank,
                epoch=epoch,
                skip=skip,
                seed=seed,
                shuffle_buffer=shuffle_buffer if shuffle else 0,
                drop_last=drop_last,
                evaluation=evaluation,
                collate=collate,
            )
            return DataLoader(split, batch_size=None, collate_fn=as_is, **options)

        return ShardedLoader(
            make_pass(0, 0), device=device, batch=batch, kind=kind, make_pass=make_pass, boundary=boundary
        )
    hf = is_hf_iterable(dataset)
    if hf and shuffle:  # HF's own buffer, reseeded by set_epoch
        dataset = dataset.shuffle(seed=seed, buffer_size=shuffle_buffer)
    if kind == "hf":
        from datasets.distributed import split_dataset_by_node  # only for a Hugging Face source

        dataset, kind = split_dataset_by_node(dataset, rank=rank, world_size=world), "presplit"
    if kind == "presplit":
        if not hf and (isinstance(dataset, IterableDataset) or not hasattr(dataset, "__getitem__")):
            dataset = Iterated(dataset, shuffle_buffer if shuffle else 0, seed + 7919 * rank)
        return _own_part(
            dataset,
            batch,
            rank=rank,
            device=device,
            seed=seed,
            shuffle=shuffle,
            drop_last=drop_last,
            evaluation=evaluation,
            options=options,
            boundary=boundary,
        )
    user_sampler, user_batches = options.pop("sampler", None), options.pop("batch_sampler", None)
    if (user_sampler is not None or user_batches is not None) and evaluation:
        raise problem(
            "sampler=/batch_sampler= with evaluation=True: evaluation reads every sample once, in order",
            "Drop them for the evaluation loader",
        )
    if user_batches is not None:  # its batches are global micro-batches; each rank its part
        batches = SharedBatchSampler(user_batches, rank=rank, world=world, seed=seed)
        loader = DataLoader(dataset, batch_sampler=batches, **options)
        return ShardedLoader(loader, device=device, batch=batch, kind="sampler", boundary=boundary)
    if user_sampler is not None:
        order = SharedOrderSampler(
            user_sampler, rank=rank, world=world, per_rank=batch.per_rank, seed=seed, drop_last=drop_last
        )
        loader = DataLoader(dataset, batch_size=batch.per_rank, sampler=order, **options)
        return ShardedLoader(loader, device=device, batch=batch, kind="sampler", boundary=boundary)
    size = len(dataset)
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
    loader = DataLoader(
        dataset, batch_size=batch.per_rank, sampler=sampler, drop_last=drop_last and not evaluation, **options
    )
    return ShardedLoader(loader, device=device, batch=batch, boundary=boundary)


def _own_part(
    dataset: Any,
    batch: BatchPlan,
    *,
    rank: int,
    device: torch.device,
    seed: int,
    shuffle: bool,
    drop_last: bool,
    evaluation: bool,
    options: dict[str, Any],
    boundary: Callable[[bool], None] | None,
) -> ShardedLoader:
    """A rank's own part (pre-split): read whole, never split again; training passes end together."""
    sampler = None
    if not isinstance(dataset, IterableDataset):
        size = torch.tensor([len(dataset)], dtype=torch.int64, device=device)
        if dist.is_available() and dist.is_initialized() and not evaluation:  # as many as the longest
            dist.all_reduce(size, op=dist.ReduceOp.MIN if drop_last else dist.ReduceOp.MAX)
        target = int(size.item())
        sampler = OwnPartSampler(
            len(dataset), target if not evaluation else len(dataset), rank=rank, shuffle=shuffle, seed=seed
        )
    loader = DataLoader(dataset, batch_size=batch.per_rank, sampler=sampler, drop_last=drop_last, **options)
    return ShardedLoader(
        loader,
        device=device,
        batch=batch,
        kind="presplit",
        equalise=sampler is None and not evaluation,
        boundary=boundary,
    )
