"""Output shared by the bench commands: aligned terminal tables, JSON next to PNG plots, the machine line.

Every report starts with what could distort it: the load average when the run started and ended (other
users on the machine slow some rounds more than others), cores, torch version.
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Sequence
from typing import Any


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table; numbers right-aligned, text left-aligned."""
    cells = [[str(h) for h in headers]] + [[_fmt(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [all(_is_number(row[i]) for row in rows) if rows else False for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        padded = zip(row, widths, numeric, strict=True)
        return "  ".join(c.rjust(w) if n else c.ljust(w) for c, w, n in padded).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), sep, *(line(r) for r in cells[1:])]).rstrip()


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return "" if v is None else str(v)


def machine() -> dict[str, Any]:
    import torch

    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "cores": cores,
        "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def cpu_steal() -> tuple[int, int] | None:
    """(total, stolen) CPU ticks since boot from /proc/stat; stolen = time the hypervisor gave this
    machine's virtual CPUs to someone else. None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    return sum(fields), fields[7] if len(fields) > 7 else 0


def load_note(
    before: Sequence[float] | None,
    after: Sequence[float] | None,
    cores: int,
    steal: tuple[tuple[int, int] | None, tuple[int, int] | None] = (None, None),
) -> str:
    """One line on how quiet the machine was; flags the figures as provisional when others competed.

    Two signs: a load average above half the cores *before* the run (the run's own ranks raise it
    afterwards, so the end value is shown, not judged), and CPU steal above 5 % during the run (a virtual
    machine whose host lent its cores to others: every timing stretches unevenly).
    """
    if not before or not after:
        return ""
    text = f"load average {before[0]:.2f} at start, {after[0]:.2f} at end (this run included), {cores} cores"
    busy = before[0] > 0.5 * cores
    start, end = steal
    if start and end and end[0] > start[0]:
        share = (end[1] - start[1]) / (end[0] - start[0])
        text += f"; CPU steal {share:.0%} of the run"
        busy = busy or share > 0.05
    if busy:
        text += " -- the machine was busy: treat these figures as provisional"
    return text


def write_json(path: str, data: dict[str, Any]) -> str:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=str)
    return path


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3
