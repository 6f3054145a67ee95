"""What one rank knows and says: its place among the ranks, printing once, and the collectives a
training script calls (`s.all_reduce`, `s.any_rank`, ...). `Session` builds on it; anything that needs
only this (collectives, the strategies' checks) can be given a `RankContext`, not the session.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

import torch
import torch.distributed as dist

from ddpkit.cluster import topology
from ddpkit.parallel import collectives


class RankContext:
    """This process's rank, device and output (global rank 0 prints); a `collectives.Ranks`."""

    def __init__(self, plan: topology.Placement, *, verbose: bool = True) -> None:
        self.plan = plan
        self.verbose = verbose
        self.device = torch.device(plan.device)

    # -- who am I -------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """Global rank: 0..world_size-1 over all nodes."""
        return self.plan.ranks.rank

    @property
    def local_rank(self) -> int:
        """Rank on this node: selects the GPU."""
        return self.plan.ranks.local_rank

    @property
    def world_size(self) -> int:
        return self.plan.ranks.world_size

    @property
    def is_main(self) -> bool:
        """True on global rank 0: the rank whose `print` prints (once for the job), for a script's own
        once-only work (a log line, a plot, a file of its own). Not a guard for the collectives: every rank
        calls `s.save`, `s.load`, `s.export`, `all_reduce`, `gather`, ... (rank 0 writes a checkpoint's
        shared files itself, every rank its own part)."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.plan.distributed

    # -- output ---------------------------------------------------------------------------------
    def print(self, *args: Any, sep: str = " ", end: str = "\n", file: TextIO | None = None) -> None:
        """`print` on global rank 0 only, flushed at once, in one write (see `print_all`)."""
        if self.is_main and self.verbose:
            bars = sys.modules.get("tqdm")
            if bars is not None and getattr(bars.tqdm, "_instances", None) and file is None and end == "\n":
                bars.tqdm.write(sep.join(map(str, args)) + end, end="")  # above the bar; one write
            else:
                _write(file or sys.stdout, sep.join(map(str, args)) + end)

    def print_all(self, *args: Any) -> None:
        """Print on every rank, prefixed with the global rank (for debugging)."""
        _write(sys.stdout, " ".join([f"[rank {self.rank}]", *map(str, args)]) + "\n")

    # -- collectives ----------------------------------------------------------------------------
    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def all_reduce(self, value: float | torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce a number or tensor over all ranks ("sum", "mean", "max", "min"); a new tensor."""
        return collectives.all_reduce(self, value, op)

    def any_rank(self, flag: bool) -> bool:
        """True on every rank if `flag` is true on any rank: stop decisions that cannot diverge."""
        return collectives.stop_flag(self, flag, "any")

    def all_ranks(self, flag: bool) -> bool:
        """True on every rank if `flag` is true on all ranks."""
        return collectives.stop_flag(self, flag, "all")

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's tensor concatenated along dim 0 in rank order (first dimensions may differ)."""
        return collectives.gather(self, tensor)

    def gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable object, in rank order."""
        return collectives.gather_object(self, obj)


def _write(stream: TextIO, text: str) -> None:
    """One write, then a flush. Ranks share their launcher's stdout, and under unbuffered output (`python -u`,
    PYTHONUNBUFFERED, which many CI systems set) `print` writes each argument and the newline apart, so two
    ranks' lines (or a rank's and the launcher's) interleave mid-line; a pipe keeps one write of up to 4 KiB
    whole."""
    stream.write(text)
    stream.flush()
