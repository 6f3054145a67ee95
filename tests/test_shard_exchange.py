"""The reduce-scatter step (ddpkit.step.shard_exchange): the weights and norms of the all-reduce path bit
for bit at 2 ranks, clipping and token weighting on shards, active from the second step."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ddpkit.step.shm_allreduce import ShmAllReduce

pytestmark = pytest.mark.numerics  # .ci/run runs these again under ATEN_CPU_CAPABILITY=default


def scatter_vs_all_reduce(seed: int) -> bool:
    """Random tensors of several sizes (across chunk boundaries): the reduce-scatter's owned tensors are
    bitwise the shm all-reduce's, the others untouched."""
    shm = ShmAllReduce(chunk_mb=0.004)  # 4 KiB chunks: tensors straddle them
    try:
        g = torch.Generator().manual_seed(seed + dist.get_rank())
        tensors = [torch.randn(n, generator=g) for n in (1, 700, 3000, 5, 2048, 1025)]
        owners = [i % dist.get_world_size() for i in range(len(tensors))]
        scattered = [t.clone() for t in tensors]
        shm.reduce_scatter_mean_(scattered, owners)
        reduced = [shm.all_reduce_mean_(t.clone()) for t in tensors]
        rank = dist.get_rank()
        return all(
            torch.equal(s, r if o == rank else t)
            for s, r, t, o in zip(scattered, reduced, tensors, owners, strict=True)
        )
    finally:
        shm.close()


def test_reduce_scatter_is_the_all_reduce_on_owned_tensors(pool2, pool3) -> None:
    assert pool2.run(scatter_vs_all_reduce, 1) == [True, True]
    assert pool3.run(scatter_vs_all_reduce, 2) == [True, True, True]
