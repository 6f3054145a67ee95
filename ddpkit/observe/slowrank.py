"""Every rank's step anatomy on rank 0, and the slow rank named once, with where its time goes.

Every `every` optimizer steps each rank puts its rolling medians (`ddpkit.observe.anatomy`) into a
tensor of 9 numbers and ONE all_gather brings them to every rank (the first time, the host names too,
with one gather of objects). Under data parallelism the ranks meet in the gradient all-reduce, so a rank
that is slow in its own work makes every other rank wait there: the others' "sync" grows, its own
"busy" (the step without the sync wait) is the longest. The detector flags rank r when

    busy[r] - median(busy of the others) > max(absolute_s, relative * median step of the others)
    and the others wait longer in sync than r does (they wait for r, not r for them)

at `persistence` gathers in a row (rolling medians over 20 steps, then 3 gathers: a scheduling hiccup
on a busy machine moves neither). The cause is the phase where r's median exceeds the others' most:
data loading, compute (forward + backward), the optimizer step, or the loop's own work between steps.
It is said once per (rank, cause), on rank 0, in the output and as tracker scalars.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass
from statistics import median
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.errors import problem
from ddpkit.observe.anatomy import FIELDS, StepAnatomy, as_row, from_rows
from ddpkit.parallel.collectives import Ranks, gather_object

CAUSES = {
    "data": ("in data loading", "raise num_workers, or check this host's disk and CPU load"),
    "compute": (
        "in forward/backward",
        "check this host's clock and threads (throttling, another process on its cores)",
    ),
    "optimizer": ("in the optimizer step", "check this host's clock and threads"),
    "other": (
        "outside the step (the loop's own work between steps)",
        "check what this rank does between steps (callbacks, logging)",
    ),
}
CAUSE_CODES = {name: i for i, name in enumerate(CAUSES)}  # tracker scalar anatomy/slow_cause


@dataclass(frozen=True)
class Finding:
    """A slow rank: how much longer its own work is per step than the others', and where."""

    rank: int
    host: str
    excess_s: float
    busy_s: float
    others_busy_s: float
    cause: str  # a key of CAUSES
    step: int  # the optimizer step it was named at

    def message(self) -> str:
        where, advice = CAUSES[self.cause]
        return (
            f"slow rank: rank {self.rank} on {self.host}: +{self.excess_s * 1e3:.0f} ms per step "
            f"({self.busy_s * 1e3:.0f} ms of its own work vs {self.others_busy_s * 1e3:.0f} ms on the "
            f"others, who wait for it in the gradient all-reduce), {where}: {advice}"
        )


def _cause_parts(row: dict[str, float]) -> dict[str, float]:
    return {
        "data": row["data"],
        "compute": row["forward"] + row["backward"],
        "optimizer": row["optimizer"],
        "other": row["other"],
    }


class SlowRankDetector:
    """Pure: `update(table)` with every rank's medians; a `Finding` the first time a rank qualifies."""

    def __init__(self, *, relative: float = 0.10, absolute_s: float = 0.005, persistence: int = 3) -> None:
        if relative < 0 or absolute_s < 0 or persistence < 1:
            raise problem(
                f"slow-rank thresholds relative={relative}, absolute_s={absolute_s}, "
                f"persistence={persistence} are out of range",
                "Pass relative >= 0, absolute_s >= 0 and persistence >= 1",
            )
        self.relative, self.absolute_s, self.persistence = relative, absolute_s, persistence
        self.streak: tuple[int, str] | None = None  # (rank, cause) and how many gathers in a row
        self.count = 0
        self.said: set[tuple[int, str]] = set()

    def suspect(self, table: list[dict[str, float]]) -> tuple[int, str, float] | None:
        """(rank, cause, excess seconds) of the rank whose own work is too long now, or None."""
        if len(table) < 2 or any(row["steps"] < 1 for row in table):
            return None
        slow = max(range(len(table)), key=lambda r: table[r]["busy"])
        others = [row for r, row in enumerate(table) if r != slow]
        others_busy = median(row["busy"] for row in others)
        excess = table[slow]["busy"] - others_busy
        limit = max(self.absolute_s, self.relative * median(row["step"] for row in others))
        if excess <= limit or median(row["sync"] for row in others) <= table[slow]["sync"]:
            return None
        mine = _cause_parts(table[slow])
        theirs = [_cause_parts(row) for row in others]
        cause = max(mine, key=lambda k: mine[k] - median(t[k] for t in theirs))
        return slow, cause, excess

    def update(self, table: list[dict[str, float]], hosts: list[str], step: int) -> Finding | None:
        found = self.suspect(table)
        if found is None:
            self.streak, self.count = None, 0
            return None
        rank, cause, excess = found
        self.count = self.count + 1 if self.streak == (rank, cause) else 1
        self.streak = (rank, cause)
        if self.count < self.persistence or (rank, cause) in self.said:
            return None
        self.said.add((rank, cause))
        others = [row["busy"] for r, row in enumerate(table) if r != rank]
        return Finding(rank, hosts[rank], excess, table[rank]["busy"], median(others), cause, step)


class RankView:
    """Drives the gathers: `after_step()` after each optimizer step (on every rank: a collective)."""

    def __init__(
        self,
        ranks: Ranks,
        anatomy: StepAnatomy,
        *,
        every: int = 10,
        report: Callable[[str], Any] = print,
        detector: SlowRankDetector | None = None,
    ) -> None:
        if every < 1:
            raise problem(f"anatomy every={every} is below 1", "Pass 1 or more optimizer steps")
        self.ranks, self.anatomy, self.every, self.report = ranks, anatomy, every, report
        self.detector = detector or SlowRankDetector()
        self.hosts: list[str] = []
        self.table: list[dict[str, float]] = []  # the last gathered medians, one row per rank
        self.findings: list[Finding] = []

    def after_step(self, step: int) -> dict[str, float] | None:
        """Every `every` recorded steps: gather, detect; the tracker scalars of this gather, else None."""
        steps = self.anatomy.steps
        if steps == 0 or steps % self.every:
            return None
        row = torch.tensor(as_row(self.anatomy.medians(), steps), dtype=torch.float64)
        if not self.ranks.distributed:
            self.table = from_rows([row.tolist()])
            self.hosts = self.hosts or [socket.gethostname()]
            return self.scalars()
        if not self.hosts:
            self.hosts = [str(h) for h in gather_object(self.ranks, socket.gethostname())]
        on_device = row.to(self.ranks.device)
        parts = [torch.empty_like(on_device) for _ in range(self.ranks.world_size)]
        dist.all_gather(parts, on_device)
        self.table = from_rows(torch.stack(parts).cpu().tolist())
        finding = self.detector.update(self.table, self.hosts, step)
        scalars = self.scalars()
        if finding is not None:
            self.findings.append(finding)
            self.report(f"ddpkit: {finding.message()}")
            scalars.update(
                {
                    "anatomy/slow_rank": float(finding.rank),
                    "anatomy/slow_excess_ms": finding.excess_s * 1e3,
                    "anatomy/slow_cause": float(CAUSE_CODES[finding.cause]),
                }
            )
        return scalars

    def scalars(self) -> dict[str, float]:
        """Per-rank medians in ms for the trackers: anatomy/rank<r>/<phase>_ms."""
        return {
            f"anatomy/rank{r}/{name}_ms": row[name] * 1e3
            for r, row in enumerate(self.table)
            for name in FIELDS
        }

    def summary(self) -> dict[str, Any]:
        """The last table, the hosts and the findings (what `fit` returns)."""
        return {"ranks": self.table, "hosts": self.hosts, "findings": self.findings}
