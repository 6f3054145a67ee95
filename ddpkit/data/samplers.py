"""Samplers for map-style data sets: who reads which index, in which order, from where.

- `ResumableSampler` (training): a `DistributedSampler` whose next pass can start part-way.
- `EvalShardSampler` (evaluation): rank r takes r, r+W, ... without padding.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DistributedSampler, Sampler


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
