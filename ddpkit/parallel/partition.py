"""Which rank owns which tensor in a sharded optimizer step (ZeRO-1): one pure rule, no torch.

    owner = partition([p.numel() for p in params], world)   # owner[i]: the rank that steps params[i]

The sharded step (`ddpkit.step.sharding`) and `ddpkit plan --memory` (its ZeRO-1 estimate) both call
it, so the plan counts the bytes of the parameters the step will in fact give each rank.
"""

from __future__ import annotations


def partition(sizes: list[int], world: int) -> list[int]:
    """Owner rank of each tensor: largest first, to the least-loaded rank (ties: lower index, rank)."""
    load = [0] * world
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner
