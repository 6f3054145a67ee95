"""Why DistributedSampler and set_epoch: duplicate work without the one, a repeated order without the other.

    python examples/sampler_epochs.py              # 2 gloo ranks on this machine
    ddpkit run --nproc 2 examples/sampler_epochs.py

Each rank reads a data set of 16 samples (their indices) for 2 epochs, three ways:

1. a plain shuffled DataLoader: every rank reads all 16 samples, so 2 ranks do the same work twice
   (and, shuffled with the same seed, even in the same order) -- a step of DDP then is no bigger
   than one process's step, only more expensive;
2. a DistributedSampler without set_epoch: the ranks split the samples (8 each, disjoint), but
   epoch 1 repeats epoch 0's order exactly, because the shuffle is seeded with (seed + epoch);
3. the fix, set_epoch(epoch) before every epoch: disjoint shards and a new order every epoch.
   `s.loader(...)` does this for you.
"""

from __future__ import annotations

import os

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ddpkit

N, EPOCHS = 16, 2


def _epochs(loader: DataLoader, sampler: DistributedSampler | None, set_epoch: bool) -> list[list[int]]:
    order = []
    for epoch in range(EPOCHS):
        if sampler is not None and set_epoch:
            sampler.set_epoch(epoch)
        order.append([int(i) for (batch,) in loader for i in batch])
    return order


def read_three_ways() -> dict[str, list[list[int]]]:
    """The indices this rank reads in each epoch: {way: [epoch 0 indices, epoch 1 indices]}."""
    with ddpkit.session(seed=0, verbose=False) as s:
        data = TensorDataset(torch.arange(N))
        plain = DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0))
        sampler = DistributedSampler(data, num_replicas=s.world_size, rank=s.rank, shuffle=True, seed=0)
        sharded = DataLoader(data, batch_size=4, sampler=sampler)
        fixed = DistributedSampler(data, num_replicas=s.world_size, rank=s.rank, shuffle=True, seed=0)
        return {
            "no_sampler": _epochs(plain, None, False),
            "no_set_epoch": _epochs(sharded, sampler, False),
            "set_epoch": _epochs(DataLoader(data, batch_size=4, sampler=fixed), fixed, True),
            "ddpkit_loader": _epochs(s.loader(data, batch_size=4 * s.world_size, shuffle=True), None, False),
        }


def summary(per_rank: list[dict[str, list[list[int]]]]) -> dict[str, dict[str, bool]]:
    """For each way: do the ranks share work (overlap), and does epoch 1 repeat epoch 0 on a rank?"""
    out = {}
    for way in per_rank[0]:
        epoch0 = [set(r[way][0]) for r in per_rank]
        out[way] = {
            "ranks_overlap": any(a & b for i, a in enumerate(epoch0) for b in epoch0[i + 1 :]),
            "all_samples_covered": set().union(*epoch0) == set(range(N)),
            "order_repeats": all(r[way][0] == r[way][1] for r in per_rank),
        }
    return out


def main() -> None:
    if "RANK" in os.environ:  # started by a launcher: every rank prints what it read
        print(f"rank {os.environ['RANK']}: {read_three_ways()}", flush=True)
        return
    per_rank = ddpkit.spawn(read_three_ways, nproc=2)
    for way, facts in summary(per_rank).items():
        print(f"{way:>14}: rank 0 reads {per_rank[0][way]}, rank 1 reads {per_rank[1][way]}")
        print(f"{'':>14}  {facts}")


if __name__ == "__main__":
    main()
