"""Where a pass stands, in a checkpoint, and how a saved position resumes (per kind of source).

The position is the epoch and the samples consumed in it counted over all ranks (per-rank samples x
world size), so it keeps its meaning when the world size changes. What another world size does:

    map       the rest of the epoch's global order (DistributedSampler's), split over the new ranks:
              needs samples divisible by the new world size (a paragraph otherwise)
    stream    re-split from the global position: the stream's rest is cut into the new world's
    sampler   micro-batches from that sample on (exact once, any world size); `sampler` is the order
              of the user's sampler, cut the same way
    presplit  each rank's position belongs to its old part, which no longer exists: the epoch restarts
              from its first sample (said in a line)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ddpkit.errors import problem


def resume_point(kind: str, state: Mapping[str, Any], world: int) -> tuple[int, int, str | None]:
    """(epoch, global samples the next pass skips, a note) for `state` in a loader of `kind`."""
    saved_kind = state.get("kind", "map")
    epoch, samples = int(state["epoch"]), int(state["samples"])
    if saved_kind != kind:
        raise problem(
            f"the saved data position is of a {saved_kind} source, this loader reads a {kind} source",
            "Load it into a loader built over the same data set (same s.loader(...) call) as when saved",
        )
    saved_world = int(state["world_size"])
    if kind == "presplit" and saved_world != world and samples:
        return (
            epoch,
            0,
            (
                f"pre-split source: world size {saved_world} -> {world}: each rank's position belonged "
                f"to its old part, so epoch {epoch} restarts from its first sample"
            ),
        )
    if kind in ("stream", "sampler"):
        if saved_world != world and samples:
            return epoch, samples, f"{kind} re-split from global sample {samples} over {world} rank(s)"
        return epoch, samples, None
    if samples % world:
        raise problem(
            f"the saved data position ({samples} samples into epoch {epoch}) cannot be split "
            f"over world size {world}",
            f"Resume with a world size that divides {samples}, or at the start of an epoch",
        )
    return epoch, samples, None
