"""How a batch splits: the global batch over ranks and accumulation steps, and elastic jobs' rule.

`batch_size` is the global batch: per-rank batch = global / (world size x accumulation steps).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

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

    `ddpkit run --nnodes MIN:MAX` runs at any world size up to the most nodes' (ELASTIC_WORLD_ENV); the
    global batch stays the user's either way. "per-rank" keeps the per-rank batch, which is what fits a
    GPU's memory, and accumulates more micro-batches (the loop must run `with s.accumulate(model)`);
    "accumulation" keeps the accumulation and the per-rank batch grows (`plan_batch` splits the global
    batch over fewer ranks), which every loop survives, plain `loss.backward(); opt.step()` included.
    "auto" (the default): "per-rank" for a session that accumulates (accumulation > 1: its loop has
    the block), "accumulation" for one that does not (its loop may have no block at all).
    """
    most = int(env.get(ELASTIC_WORLD_ENV, "0") or 0)
    mode = env.get(ELASTIC_BATCH_ENV, "auto")
    if mode == "auto":
        mode = "per-rank" if accumulation > 1 else "accumulation"
    if most <= world_size:
        return accumulation, None
    if mode != "per-rank":
        return accumulation, (
            f"elastic: world size {world_size} of up to {most}: the per-rank batch grows "
            f"{most / world_size:g}x (accumulation stays {accumulation}: this session does not accumulate), "
            f"so the global batch stays as at {most}"
        )
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
