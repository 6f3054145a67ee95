"""What a training run reports as it goes: progress for a person or a log file, and the run's log.

On a terminal: tqdm's bar, refreshed in place. When stdout or stderr is a file (Slurm, Kubernetes, `> log`):
one plain line at a time, no carriage returns, at most every `every_s` seconds and at every tenth of
the run when its length is known, plus the last step:

    fit: step 120/500 (24%), epoch 3, loss 0.1234, 812 samples/s, 12.3 ms/step, 41.2 TFLOP/s, MFU 42%,
         31 s left

(`detail`, from `ddpkit.observe.monitor`, gives the FLOP/s and MFU part for the window's step time.)

`RunLog` writes rows to a JSON-lines or CSV file (global rank 0 only); the trackers are
`ddpkit.observe.tracking`.
"""

from __future__ import annotations

import csv
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from ddpkit.errors import problem


def is_terminal(*streams: TextIO) -> bool:
    """True when every stream is a terminal (tqdm draws on stderr; a log usually captures both)."""
    try:
        return all(stream.isatty() for stream in streams or (sys.stdout, sys.stderr))
    except (AttributeError, ValueError):  # replaced or closed streams (notebooks, pytest capture)
        return False


class Progress:
    """`update(step, epoch, loss, samples)` after each optimizer step; `close()` at the end."""

    def __init__(
        self, total: int | None, *, desc: str = "fit", every_s: float = 10.0, stream: TextIO | None = None
    ) -> None:
        self.total, self.desc, self.every_s = total, desc, every_s
        self.stream = stream
        self.bar: Any = None
        if is_terminal(*([stream] if stream else [])):
            from tqdm import tqdm

            self.bar = tqdm(
                total=total, desc=desc, unit="step", leave=False, dynamic_ncols=True, mininterval=0.5
            )
        self.start = time.perf_counter()
        self.last_line = self.start  # time of the last plain line
        self.last_tenth = 0
        self.window_steps = self.window_samples = 0  # since the last plain line

    def update(
        self, step: int, epoch: int, loss: float, samples: int, detail: Callable[[float], str] | None = None
    ) -> None:
        """After optimizer step `step`, which took `samples` samples over all ranks (0: unknown);
        `detail(seconds per step)` adds to the plain line (e.g. "41.2 TFLOP/s, MFU 42%")."""
        if self.bar is not None:
            self.bar.update(1)
            perf = detail((time.perf_counter() - self.start) / step) if detail and step else ""  # mean so far
            self.bar.set_postfix(epoch=epoch, loss=f"{loss:.4f}", **({"perf": perf} if perf else {}))
            return
        self.window_steps += 1
        self.window_samples += samples
        now = time.perf_counter()
        tenth = 10 * step // self.total if self.total else 0
        final = self.total is not None and step >= self.total
        if not (final or tenth > self.last_tenth or now - self.last_line >= self.every_s or step == 1):
            return
        seconds = now - max(self.last_line, self.start)
        rate = self.window_samples / seconds if self.window_samples and seconds > 0 else None
        step_s = seconds / self.window_steps
        text = self.line(step, epoch, loss, rate, step_s, now - self.start, detail(step_s) if detail else "")
        print(text, file=self.stream or sys.stdout, flush=True)
        self.last_line, self.last_tenth, self.window_steps, self.window_samples = now, tenth, 0, 0

    def line(
        self,
        step: int,
        epoch: int,
        loss: float,
        samples_per_s: float | None,
        step_s: float,
        elapsed: float,
        detail: str = "",
    ) -> str:
        where = f"step {step}" if not self.total else f"step {step}/{self.total} ({step / self.total:.0%})"
        parts = [f"{self.desc}: {where}", f"epoch {epoch}", f"loss {loss:.4g}"]
        if samples_per_s is not None:
            parts.append(f"{samples_per_s:.0f} samples/s")
        parts.append(f"{step_s * 1e3:.1f} ms/step")
        if detail:
            parts.append(detail)
        if self.total:
            left = elapsed / step * (self.total - step)
            parts.append(f"{left:.0f} s left")
        return ", ".join(parts)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class RunLog:
    """Rows to a JSON-lines or CSV file, written by global rank 0 only.

    A fresh run empties the file; a resumed one (`resumed`: the session loaded a checkpoint, or has
    stepped before) appends to it, so the rows of the run it continues stay above its own (a CSV file's
    columns are read back, and a new column rewrites the file with every row)."""

    def __init__(self, path: str | os.PathLike | None, enabled: bool, *, resumed: bool = False) -> None:
        self.path = None if path is None or not enabled else os.fspath(path)
        self.rows: list[dict[str, Any]] = []
        self.columns: list[str] = []
        if self.path is None:
            return
        if not self.path.endswith((".jsonl", ".json", ".csv")):
            raise problem(f"log={self.path!r} has no .jsonl or .csv suffix", "Name it e.g. run/log.jsonl")
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        if not (resumed and os.path.exists(self.path)):
            open(self.path, "w").close()
        elif self.path.endswith(".csv"):
            with open(self.path, newline="") as f:
                reader = csv.DictReader(f)
                self.rows = list(reader)
                self.columns = list(reader.fieldnames or [])

    def write(self, row: dict[str, Any]) -> None:
        if self.path is None:
            return
        if not self.path.endswith(".csv"):
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
            return
        self.rows.append(row)
        new = [k for k in row if k not in self.columns]
        self.columns += new
        with open(self.path, "w" if new else "a", newline="") as f:  # a new column rewrites the file
            writer = csv.DictWriter(f, fieldnames=self.columns)
            if new:
                writer.writeheader()
                writer.writerows(self.rows)
            else:
                writer.writerow(row)
