"""The largest micro-batch that fits a device, with the accumulation that keeps the global batch, and
what to try when none does; each candidate estimated by `ddpkit.plan.memory`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ddpkit.errors import problem
from ddpkit.observe.memory_breakdown import Breakdown
from ddpkit.plan.memory import MemoryJob, estimate


@dataclass(frozen=True)
class Fit:
    """A micro-batch per rank, the accumulation that keeps the global batch, and its estimate."""

    micro_batch: int
    accumulation: int
    breakdown: Breakdown


def splits(global_batch: int, world: int) -> list[tuple[int, int]]:
    """(micro-batch, accumulation) pairs with micro x accumulation x world == global, largest first
    (`world`: the ranks that read different batches, `MemoryJob.readers`)."""
    if global_batch < world or global_batch % world:
        raise problem(
            f"global batch {global_batch} does not split evenly over {world} ranks",
            f"Use a multiple of {world}, e.g. {world * max(1, round(global_batch / world))}",
        )
    per_rank = global_batch // world
    return [(m, per_rank // m) for m in range(per_rank, 0, -1) if per_rank % m == 0]


def largest_fit(
    job: MemoryJob,
    global_batch: int,
    capacity: int,
    *,
    allowance: float,
    reserved: int,
    measured: dict[int, Breakdown] | None = None,
) -> tuple[Fit | None, dict[int, Breakdown]]:
    """The largest micro-batch whose step fits in `capacity` bytes with its accumulation for
    `global_batch`, and every estimate made on the way (micro-batch -> breakdown).

    A step's peak grows with the micro-batch by the activations and temporaries, close to linearly:
    two estimates give the slope, the candidate predicted to fit is estimated for real, and a miss
    moves to the next smaller candidate (a few fake steps in all, not one per candidate)."""
    seen: dict[int, Breakdown] = dict(measured or {})

    def total(m: int) -> int:
        if m not in seen:
            seen[m] = estimate(replace(job, micro_batch=m))
        return seen[m].with_device(allowance, reserved).total

    options = splits(global_batch, job.readers)
    sizes = [m for m, _ in options]
    if total(sizes[0]) <= capacity:
        return Fit(options[0][0], options[0][1], seen[sizes[0]].with_device(allowance, reserved)), seen
    if total(1) > capacity:
        return None, seen
    small, big = 1, sizes[0]
    slope = (total(big) - total(small)) / max(1, big - small)
    guess = small + (capacity - total(small)) / slope if slope > 0 else big
    for m, k in options:
        if m > guess * 1.02 and m != 1:
            continue
        if total(m) <= capacity:
            return Fit(m, k, seen[m].with_device(allowance, reserved)), seen
    return Fit(1, options[-1][1], seen[1].with_device(allowance, reserved)), seen


def alternatives(job: MemoryJob) -> list[MemoryJob]:
    """What to try when micro-batch 1 does not fit, most effective first: FSDP (model state / N), under
    TP twice the tensor degree (when it divides the world), activation checkpointing, bf16
    (activations halved)."""
    out: list[MemoryJob] = []
    if job.strategy in ("ddp", "zero1") and job.world > 1:
        out.append(
            replace(
                job,
                strategy="fsdp",
                micro_batch=1,
                precision="bf16" if job.precision == "fp16" else job.precision,
            )
        )
    tensor = job.layout.tensor
    if tensor > 1 and job.world % (2 * tensor * (job.shard_degree or 1)) == 0:  # TP: the layers split finer
        degrees = tuple((d, v) for d, v in job.other_degrees if d != "tensor")
        out.append(replace(job, other_degrees=(*degrees, ("tensor", 2 * tensor)), micro_batch=1))
    if not job.activation_checkpointing:
        out.append(replace(job, activation_checkpointing="auto", micro_batch=1))
    if job.precision == "fp32":
        out.append(replace(job, precision="bf16", micro_batch=1))
    return out
