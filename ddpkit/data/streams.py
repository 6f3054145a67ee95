"""Iterable sources split over ranks x DataLoader workers, with the same number of batches on every rank.

**Index split** (any iterable that yields the same sequence in every process). Every reader (each
DataLoader worker of each rank, or the rank itself without workers) reads the epoch's whole stream in
the same order and keeps its part:

    the stream cut into global micro-batches of W x B samples (W ranks, B samples per rank):
    | rank 0: B | rank 1: B | ... | rank W-1: B | rank 0: B | ...
    rank r's j-th batch is collated by its worker j mod K (K workers)

torch's DataLoader asks its workers in turn, so a rank's batches come out in the same order for any
number of workers (0, 1, 2, ...). Each sample is read by W x K readers and trained on once. A global
micro-batch is a contiguous slice of the stream at every world size, so the position (samples of the
stream consumed) resumes at any world size: the rest of the epoch is cut from there.

**The tail** (the last R < W x B samples): every reader has counted the whole stream, so all agree on
it without a collective. `drop_last=True` drops it (at most W x B - 1 samples unseen). Otherwise it is
padded with the epoch's first samples to a multiple of W and split evenly: every rank gets one smaller
last batch of ceil(R / W) samples and at most W - 1 samples are trained twice (DistributedSampler's
rule). Evaluation pads nothing: the tail's ceil(R / W)-sample slices, so some ranks may have one batch
fewer (evaluation has no per-batch collective, so nothing waits).

**Shuffling**: `shuffle=True` passes the stream through a buffer of `shuffle_buffer` samples whose
generator is seeded by (seed, epoch): the same order in every reader, another every epoch. A source
with `set_epoch(epoch)` is told the epoch before every pass (Hugging Face datasets reshuffle by it).

**Sources split per rank already** (`presplit=True`, a Hugging Face `IterableDataset` after
`split_dataset_by_node`): ddpkit splits nothing; ranks may then hold different numbers of batches, so
`equalised` ends every rank's epoch at the shortest rank's last batch (one all-reduce per 8 batches;
what the longer ranks hold beyond it is not trained that epoch).
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info


def shuffled(stream: Iterable[Any], size: int, seed: int) -> Iterator[Any]:
    """A buffered shuffle: fill `size` samples, then emit a random one for each new sample read."""
    rng = random.Random(seed)
    buffer: list[Any] = []
    for row in stream:
        if len(buffer) < size:
            buffer.append(row)
            continue
        i = rng.randrange(size)
        yield buffer[i]
        buffer[i] = row
    rng.shuffle(buffer)
    yield from buffer


def rank_rows(
    stream: Iterable[Any], *, rank: int, world: int, per_rank: int, skip: int, pad: bool, drop_last: bool
) -> Iterator[list[Any]]:
    """Rank `rank`'s batches (lists of samples) of `stream`, the first `skip` samples left out.

    Global micro-batches are counted from `skip` on, so a position saved at one world size cuts the
    rest of the epoch at another. The tail follows the module docstring's rule.
    """
    chunk = world * per_rank
    first, last = rank * per_rank, (rank + 1) * per_rank
    head: list[Any] = []  # the epoch's first samples: what pads the tail
    rows: list[Any] = []  # this chunk's samples up to this rank's end (the tail's slice needs them)
    count = 0  # samples of the current chunk read
    for position, row in enumerate(stream):
        if len(head) < world:
            head.append(row)
        if position < skip:
            continue
        if count < last:
            rows.append(row)
        count += 1
        if count == chunk:
            yield rows[first:last]
            rows, count = [], 0
    if count == 0 or drop_last:
        return
    each = math.ceil(count / world)
    if pad:
        rows = rows + list(itertools.islice(itertools.cycle(head), max(0, each * world - count)))
    tail = rows[rank * each : (rank + 1) * each]
    if tail:
        yield tail


class StreamSplit(IterableDataset):
    """What each reader of one rank iterates for one pass: its rank's batches, every K-th one, collated.

    Built anew for every pass (epoch and start position are fixed in it), so persistent workers, which
    would keep the first pass's copy, are refused by `make_loader`.
    """

    def __init__(
        self,
        source: Any,
        *,
        rank: int,
        world: int,
        per_rank: int,
        epoch: int,
        skip: int,
        seed: int,
        shuffle_buffer: int,
        drop_last: bool,
        evaluation: bool,
        collate: Callable[[list[Any]], Any],
    ) -> None:
        self.source, self.rank, self.world, self.per_rank = source, rank, world, per_rank
        self.epoch, self.skip, self.seed, self.shuffle_buffer = epoch, skip, seed, shuffle_buffer
        self.drop_last, self.evaluation, self.collate = drop_last, evaluation, collate

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if callable(getattr(self.source, "set_epoch", None)):
            self.source.set_epoch(self.epoch)
        stream: Iterable[Any] = self.source
        if self.shuffle_buffer:
            stream = shuffled(stream, self.shuffle_buffer, self.seed * 1_000_003 + self.epoch)
        batches = rank_rows(
            stream,
            rank=self.rank,
            world=self.world,
            per_rank=self.per_rank,
            skip=self.skip,
            pad=not (self.drop_last or self.evaluation),
            drop_last=self.drop_last and not self.evaluation,
        )
        for j, rows in enumerate(batches):
            if j % workers == worker:
                yield self.collate(rows)


def as_is(batch: Any) -> Any:
    """The DataLoader's collate for `StreamSplit`: its readers collate already (module level: picklable)."""
    return batch


def equalised(batches: Iterable[Any], device: torch.device, ahead: int = 8) -> Iterator[Any]:
    """End every rank's pass at the shortest rank's last batch.

    Each rank reads up to `ahead` batches, one all-reduce (MIN) of how many it got says how many every
    rank yields; fewer than `ahead` ends the pass. One all-reduce per `ahead` batches: one per batch
    made a pass 462 us per batch instead of 107 on 2 gloo ranks (benchmarks/data_sources.py; the
    index split's stream: 79, a map-style data set: 68).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        yield from batches
        return
    count = torch.zeros(1, dtype=torch.int64, device=device)
    iterator = iter(batches)
    while True:
        held = list(itertools.islice(iterator, ahead))
        count.fill_(len(held))
        dist.all_reduce(count, op=dist.ReduceOp.MIN)
        agreed = int(count.item())
        yield from held[:agreed]
        if agreed < ahead:
            return
