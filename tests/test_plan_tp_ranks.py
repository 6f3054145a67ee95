"""The tensor-parallel memory plan against real ranks: TP(2) on 2 gloo ranks and FSDP(2) x TP(2) on 4 train
the step `ddpkit plan --memory --strategy tp` estimated on fake tensors (tests/plan_tp_ranks.py). Rank 0's
parameters and optimizer state are the estimate's to the byte, and the estimated peak is within 10 % of
the peak torch's CPU allocator reaches in that step (the CPU counterpart of
`torch.cuda.max_memory_allocated`; the bound of tests/test_plan_memory_ranks.py)."""

from __future__ import annotations

import pytest
from plan_tp_ranks import measure

from ddpkit.plan import memory
from ddpkit.plan.memory import MemoryJob

ALLOCATOR = 0.10
PLAN = '{"0": "colwise", "2": "rowwise"}'


def job(world: int, tensor: int, micro: int) -> MemoryJob:
    return MemoryJob(
        model="test_shapes_plan:mlp",
        sample="test_shapes_plan:sample",
        micro_batch=micro,
        world=world,
        strategy="tp",
        other_degrees=(("tensor", tensor),),
        tp_plan=PLAN,
        device_kind="cpu",
    )


@pytest.mark.timeout(300)
def test_the_estimate_is_what_real_tp_and_fsdp_x_tp_ranks_hold(pool2, pool4) -> None:
    """At micro-batch 64 (the step holds activations): the tracked categories of a real rank's
    step, and its allocator peak, against the fake step's."""
    for pool, world, layout in ((pool2, 2, (1, 1, 2)), (pool4, 4, (1, 2, 2))):
        ranks = pool.run(measure, job(world, 2, 64), timeout=200)
        got, real = ranks[0], ranks[0]["tracked"]
        assert got["layout"] == layout  # (replicate, shard, tensor) as the session built it
        est = memory.estimate(job(world, 2, 64)).as_dict()
        assert real["activations"] > 0.05 * real["total"]
        for part in ("parameters", "optimizer_state"):
            assert est[part] == real[part], (world, part, est, real)
        why = (world, est["total"], real["total"], got["allocator"])
        print(
            f"world {world} layout {layout}: estimate {est['total']} B, tracked {real['total']} B, allocator {got['allocator']} B"
        )
        assert abs(est["total"] / real["total"] - 1) <= 0.02, why
        assert abs(est["total"] / got["allocator"] - 1) <= ALLOCATOR, why
