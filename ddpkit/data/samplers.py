"""Samplers for map-style data sets: who reads which index, in which order, from where.

- `ResumableSampler` (training): a `DistributedSampler` whose next pass can start part-way.
- `EvalShardSampler` (evaluation): rank r takes r, r+W, ... without padding.
- `OwnPartSampler` (pre-split): a rank's own part, as long as the longest part.
- `SharedOrderSampler` (the user's `sampler=`): its global order, each rank its contiguous share.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DistributedSampler, Sampler

from ddpkit.data.streams import rank_rows


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


class OwnPartSampler(Sampler[int]):
    """A pre-split map-style data set (this rank's own part): its indices, shuffled per (seed, epoch,
    rank), wrapped around to `target` so every rank has as many (`target` is the longest part, or the
    shortest with drop_last: then the longer parts' last samples wait for another epoch's order)."""

    def __init__(self, size: int, target: int, *, rank: int, shuffle: bool, seed: int) -> None:
        self.size, self.target, self.rank, self.shuffle, self.seed = size, target, rank, shuffle, seed
        self.epoch = 0
        self.skip = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + 1_000_003 * self.epoch + 7919 * self.rank)
            order = torch.randperm(self.size, generator=g).tolist()
        else:
            order = list(range(self.size))
        whole = list(itertools.islice(itertools.cycle(order), self.target)) if order else []
        skip, self.skip = self.skip, 0
        return iter(whole[skip:])

    def __len__(self) -> int:
        return self.target


def drawn(user: Any, seed: int, epoch: int) -> list[Any]:
    """The user's sampler's whole order for `epoch`, the same in every rank (see `SharedOrderSampler`)."""
    seed = seed * 1_000_003 + epoch
    if callable(getattr(user, "set_epoch", None)):
        user.set_epoch(epoch)
    if hasattr(user, "generator"):
        user.generator = torch.Generator().manual_seed(seed)
        return list(user)
    if hasattr(getattr(user, "sampler", None), "generator"):  # torch's BatchSampler(RandomSampler(...))
        user.sampler.generator = torch.Generator().manual_seed(seed)
        return list(user)
    saved = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            random.seed(seed)
            np.random.seed(seed % 2**32)
            return list(user)
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])


class SharedOrderSampler(Sampler[int]):
    """The user's sampler (weighted, length-grouped, ...) as the global order; each rank takes its share.

    Every rank draws the epoch's whole order from the user's sampler with the same seed: a sampler with
    `set_epoch` is told the epoch, one with a `generator` attribute (RandomSampler,
    WeightedRandomSampler, SubsetRandomSampler) gets a generator seeded by (seed, epoch), and any other
    draws under torch/numpy/random seeded by (seed, epoch) (the caller's streams are put back). The
    order is then cut like a stream (`ddpkit.data.streams.rank_rows`): global micro-batch c is the
    order's slice [c*W*B, (c+1)*W*B), rank r its r-th B; the tail padded or dropped by the same rule.
    So the global batch is a contiguous run of the sampler's order (what a length-grouped sampler
    needs), the order is a function of (seed, epoch), and a position resumes at any world size.
    """

    def __init__(
        self, user: Sampler, *, rank: int, world: int, per_rank: int, seed: int, drop_last: bool
    ) -> None:
        self.user, self.rank, self.world, self.per_rank = user, rank, world, per_rank
        self.seed, self.drop_last = seed, drop_last
        self.epoch = 0
        self.skip = 0  # global samples of the order the next pass leaves out

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        skip, self.skip = self.skip, 0
        order = [int(i) for i in drawn(self.user, self.seed, self.epoch)]
        batches = rank_rows(
            order,
            rank=self.rank,
            world=self.world,
            per_rank=self.per_rank,
            skip=skip,
            pad=not self.drop_last,
            drop_last=self.drop_last,
        )
        return itertools.chain.from_iterable(batches)

    def __len__(self) -> int:
        full, rest = divmod(len(self.user), self.world * self.per_rank)  # type: ignore[arg-type]
        tail = 0 if self.drop_last or not rest else -(-rest // self.world)
        return full * self.per_rank + tail


class SharedBatchSampler(Sampler[list[int]]):
    """The user's `batch_sampler=`: each of its batches is one global micro-batch, the same in every rank
    (drawn like `SharedOrderSampler`'s order); rank r takes its contiguous part (sizes differ by at most
    one; a batch smaller than the world size is wrapped so no rank gets none). `skip` counts batches."""

    def __init__(self, user: Sampler, *, rank: int, world: int, seed: int) -> None:
        self.user, self.rank, self.world, self.seed = user, rank, world, seed
        self.epoch = 0
        self.skip = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[list[int]]:
        skip, self.skip = self.skip, 0
        for batch in drawn(self.user, self.seed, self.epoch)[skip:]:
            indices = [int(i) for i in batch]
            if len(indices) < self.world:
                indices = list(itertools.islice(itertools.cycle(indices), self.world))
            base, extra = divmod(len(indices), self.world)
            start = self.rank * base + min(self.rank, extra)
            yield indices[start : start + base + (self.rank < extra)]

    def __len__(self) -> int:
        return len(self.user)  # type: ignore[arg-type]
