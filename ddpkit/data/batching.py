"""How a batch splits: the global batch over ranks and accumulation steps, and elastic jobs' rule.

`batch_size` is the global batch: per-rank batch = global / (world size x accumulation steps).

Accumulation is a count per rank, or `Global`: the count over all ranks (`Global(40)`: 40 micro-batches
per optimizer step, nanoGPT's gradient_accumulation_steps) or a global batch and its micro-batch
(`Global(batch=480, micro_batch=12)`), resolved once the world size is known (`resolve_accumulation`),
and again at each elastic world size, so that no script divides by WORLD_SIZE itself.
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


@dataclass(frozen=True)
class Global:
    """Accumulation over the whole job: `steps` micro-batches per optimizer step over all ranks, or
    a global `batch` of `micro_batch`-sized micro-batches (steps = batch / micro_batch). Each rank
    accumulates steps / world size of them, whatever the world size the launcher gives.

        ddpkit.session(accumulation=Global(40))                          # 20 per rank at world size 2
        ddpkit.session(accumulation=Global(batch=480, micro_batch=12))   # s.loader(data): 480 a step
    """

    steps: int | None = None
    batch: int | None = None
    micro_batch: int | None = None

    def __post_init__(self) -> None:
        by_count = self.steps is not None
        if by_count == (self.batch is not None or self.micro_batch is not None) or (
            not by_count and (self.batch is None or self.micro_batch is None)
        ):
            raise problem(
                f"{self} gives neither a count alone nor a global batch with its micro-batch",
                "Pass Global(<micro-batches per optimizer step over all ranks>) or "
                "Global(batch=<global batch>, micro_batch=<per-rank micro-batch>)",
            )
        for name in ("steps", "batch", "micro_batch"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise problem(f"{self}: {name}={value!r} is not a whole number of 1 or more", "Pass one")
        if self.batch is not None and self.micro_batch is not None and self.batch % self.micro_batch:
            raise problem(
                f"{self}: the global batch {self.batch} is not a whole number of micro-batches of "
                f"{self.micro_batch}",
                f"Use a global batch that is a multiple of {self.micro_batch}",
            )

    @property
    def count(self) -> int:
        """Micro-batches per optimizer step over all ranks."""
        if self.steps is not None:
            return self.steps
        assert self.batch is not None and self.micro_batch is not None
        return self.batch // self.micro_batch

    def per_rank(self, world_size: int) -> int:
        """This world size's accumulation per rank, or one paragraph when the count does not divide."""
        if self.count % world_size:
            below = self.count // world_size * world_size
            above = below + world_size
            near = f"{below} or {above}" if below else str(above)
            unit = (
                f"micro-batches of {self.micro_batch} in the global batch {self.batch}"
                if self.batch is not None
                else "micro-batches per optimizer step"
            )
            raise problem(
                f"accumulation={self} does not divide by the world size {world_size}: {self.count} {unit} "
                f"cannot be shared evenly by {world_size} ranks",
                f"Use a count that is a multiple of {world_size} (e.g. {near}), or launch a world size that "
                f"divides {self.count}",
            )
        return self.count // world_size

    def __str__(self) -> str:
        if self.steps is not None:
            return f"Global({self.steps})"
        return f"Global(batch={self.batch}, micro_batch={self.micro_batch})"


def resolve_accumulation(
    accumulation: int | Global, world_size: int, env: Mapping[str, str]
) -> tuple[int, str | None]:
    """The accumulation per rank at this world size, and a note to print at the start (or None).

    An int is per rank, and an elastic job's rule applies (`elastic_accumulation`); a `Global` is
    divided by this world size, which keeps the micro-batch and the global batch at every world size
    an elastic job runs at (its per-rank rule in effect, whatever --elastic-batch says)."""
    if not isinstance(accumulation, Global):
        return elastic_accumulation(accumulation, world_size, env)
    per_rank = accumulation.per_rank(world_size)
    return per_rank, (
        f"accumulation={accumulation}: {per_rank} accumulation step(s) per rank at world size {world_size}, "
        f"{accumulation.count} micro-batches per optimizer step over all ranks"
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
