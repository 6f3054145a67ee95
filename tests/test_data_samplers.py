"""The user's own sampler through `s.loader(..., sampler=...)` on real gloo ranks.

Each rank takes its contiguous share of the sampler's global order, so the global batch of every step
(the ranks' batches in rank order) is the batch one process reads with the same global batch size:
checked for torch's WeightedRandomSampler (a `generator` attribute) and a length-grouped sampler that
draws from the global torch RNG. The order changes with the epoch and a stopped run resumes on it, at
the same world size and at another.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import torch
from torch.utils.data import BatchSampler, RandomSampler, Sampler, TensorDataset, WeightedRandomSampler

import ddpkit

N, GLOBAL = 40, 8


class LengthGrouped(Sampler[int]):
    """Shuffle, then sort each window of 16 by length: similar lengths end up in one batch."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths

    def __iter__(self):
        order = torch.randperm(len(self.lengths)).tolist()  # the global torch RNG: ddpkit seeds it
        windows = [order[i : i + 16] for i in range(0, len(order), 16)]
        return iter([i for w in windows for i in sorted(w, key=lambda j: self.lengths[j])])

    def __len__(self) -> int:
        return len(self.lengths)


def make_sampler(name: str) -> Sampler:
    if name == "weighted":
        return WeightedRandomSampler([1.0 + (i % 4) for i in range(N)], num_samples=N, replacement=True)
    return LengthGrouped([(i * 7) % 13 for i in range(N)])


def _two_epochs(ckpt: str | None, stop_after: int | None, **how) -> dict:
    """Two epochs of global batches of 8 sample ids, read through `s.loader(..., **how)`; with
    `stop_after`, save there and stop; with `ckpt` alone, resume from it."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), ddpkit.session(seed=4) as s:
        loader = s.loader(TensorDataset(torch.arange(N)), batch_size=GLOBAL, **how)
        if ckpt and stop_after is None:
            s.load(ckpt, loader=loader)
        seen = []
        for _ in range(2 - loader.epoch):
            for (ids,) in loader:
                seen.append(ids.tolist())
                if len(seen) == stop_after:
                    s.save(ckpt, loader=loader)
                    return {"seen": seen}
        return {"seen": seen, "batches": len(loader), "out": out.getvalue()}


def read(name: str, ckpt: str | None = None, stop_after: int | None = None) -> dict:
    """Through sampler= (the user's sampler, shared out per rank)."""
    return _two_epochs(ckpt, stop_after, sampler=make_sampler(name))


def _global(per_rank: list[dict]) -> list[list[int]]:
    return [[i for part in parts for i in part] for parts in zip(*(r["seen"] for r in per_rank), strict=True)]


@pytest.mark.parametrize("name", ["weighted", "length-grouped"])
def test_each_rank_takes_its_share_of_the_global_order(pool2, name: str) -> None:
    alone = read(name)["seen"]  # one process, global batch 8
    ranks = pool2.run(read, name)
    assert len(ranks[0]["seen"]) == len(ranks[1]["seen"]) == 2 * N // GLOBAL == 2 * ranks[0]["batches"]
    assert _global(ranks) == alone, "the global batches are not the one-process batches"
    assert alone[: N // GLOBAL] != alone[N // GLOBAL :], "the same order every epoch"
    if name == "length-grouped":  # the grouping survived the split: lengths ascend in every global batch
        lengths = [(i * 7) % 13 for i in range(N)]
        assert all([lengths[i] for i in b] == sorted(lengths[i] for i in b) for b in _global(ranks))


def test_a_stopped_run_resumes_on_the_order_at_the_same_and_another_world_size(pool2, tmp_path: Path) -> None:
    alone = read("weighted")["seen"]
    ckpt = str(tmp_path / "ckpt")
    pool2.run(read, "weighted", ckpt, 7)  # epoch 1, second batch
    assert _global(pool2.run(read, "weighted", ckpt)) == alone[7:]
    resumed = read("weighted", ckpt)  # in this process: world size 1
    assert resumed["seen"] == alone[7:]
    assert (
        "loader at epoch 1, sample 16; sampler re-split from global sample 16 over 1 rank(s)"
        in resumed["out"]
    ), resumed["out"]


class Buckets(Sampler[list[int]]):
    """A batch sampler of uneven batches (5, 8, 3 samples, ...), as token-budget samplers make them."""

    def __iter__(self):
        order = torch.randperm(N).tolist()
        sizes, start = [5, 8, 3, 9, 7, 8], 0
        for size in sizes:
            yield order[start : start + size]
            start += size

    def __len__(self) -> int:
        return 6


def read_batches(name: str, ckpt: str | None = None, stop_after: int | None = None) -> dict:
    """Like `read`, with batch_sampler= (its batches are the global micro-batches)."""
    user = (
        Buckets()
        if name == "buckets"
        else BatchSampler(RandomSampler(range(N)), batch_size=GLOBAL, drop_last=False)
    )
    return _two_epochs(ckpt, stop_after, batch_sampler=user)


@pytest.mark.parametrize("name", ["torch", "buckets"])
def test_a_batch_sampler_gives_each_rank_its_part_of_every_global_batch(
    pool2, tmp_path: Path, name: str
) -> None:
    alone = read_batches(name)["seen"]  # one process: the batch sampler's own batches
    assert _global(pool2.run(read_batches, name)) == alone, "the global batches are not the batch sampler's"
    assert alone[: len(alone) // 2] != alone[len(alone) // 2 :], "the same order every epoch"
    ckpt = str(tmp_path / "ckpt")
    pool2.run(read_batches, name, ckpt, 8)  # epoch 1
    assert _global(pool2.run(read_batches, name, ckpt)) == alone[8:], "resumed on other batches"
