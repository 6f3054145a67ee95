"""Which checkpoints a save keeps: the newest K, every Nth step, the best by a metric; never the newest.

    keep = of(keep=2, every=1000, best="val_loss", state=state)   # checked: mistakes named with their fix
    prune(root, keep, current=seq)                                 # a local root, after the commit
    keep.kept([(name, manifest), ...])                             # the same rule for a remote store

The metric is a number passed to every `s.save` (`val_loss=...`); `write` puts the save's numeric
values into its manifest ("metrics"), so the rule reads manifests only, never the checkpoints' files.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddpkit.checkpoint import files
from ddpkit.errors import problem


@dataclass(frozen=True)
class Retention:
    """Which complete checkpoints a save keeps (`s.save(keep=, keep_every=, keep_best=)`): the newest
    `last`, every one whose step is a multiple of `every`, and the one with the best value of the metric
    `best` (passed to `s.save` as a number; `mode` "min" or "max"). The newest is always kept."""

    last: int = 3
    every: int | None = None
    best: str | None = None
    mode: str = "min"

    def kept(self, manifests: list[tuple[str, Mapping[str, Any]]]) -> set[str]:
        """The names to keep among (name, manifest) pairs, newest first."""
        keep = {name for name, _ in manifests[: max(self.last, 1)]}
        if self.every:
            steps = [(n, m.get("step")) for n, m in manifests]
            keep |= {n for n, step in steps if isinstance(step, int) and step % self.every == 0}
        if self.best:
            scored = [(m.get("metrics", {}).get(self.best), n) for n, m in manifests]
            valid = [(v, n) for v, n in scored if isinstance(v, (int, float)) and v == v]  # not NaN
            if valid:
                keep.add((min if self.mode == "min" else max)(valid)[1])
        return keep


def read_manifest(path: Path) -> dict[str, Any]:
    """A checkpoint's manifest as written, unchecked ({} if unreadable): for retention, not for loading."""
    try:
        return dict(json.loads((path / files.MANIFEST).read_text()))
    except (OSError, ValueError, TypeError):
        return {}


def prune(root: Path, retention: Retention, current: int) -> list[Path]:
    """Delete complete checkpoints `retention` does not keep, and temporary directories of crashed writes
    (older than `current`, the one being written)."""
    removed = []
    found = files.candidates(root)
    kept = retention.kept([(p.name, read_manifest(p)) for p in found])
    for path in found:
        if path.name in kept or path.name == files.final_dir(root, current).name:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    for path in root.iterdir():
        if (seq := files.tmp_seq(path)) is not None and seq < current:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def of(keep: int, every: int | None, best: str | tuple[str, str] | None, state: dict[str, Any]) -> Retention:
    """`s.save`'s retention keywords, checked: each mistake named with its fix, before anything is written."""
    if not isinstance(keep, int) or keep < 1:
        raise problem(f"keep={keep} would delete the checkpoint just written", "Pass keep=1 or more")
    if every is not None and (not isinstance(every, int) or every < 1):
        raise problem(
            f"keep_every={every!r} is not a whole number of steps",
            "Pass keep_every=N (N >= 1): every checkpoint whose step is a multiple of N is kept",
        )
    if best is None:
        return Retention(keep, every)
    name, mode = (best, "min") if isinstance(best, str) else best
    value = state.get(name)
    if mode not in ("min", "max") or not isinstance(value, (int, float)) or isinstance(value, bool):
        raise problem(
            f"keep_best={best!r} needs a number named {name!r} in every save (got {name}={value!r}) and "
            f"'min' or 'max'",
            f"Pass the metric to the save, e.g. s.save(root, ..., keep_best={name!r}, {name}=val_loss), "
            f"and keep_best=({name!r}, 'max') for a metric where higher is better",
        )
    return Retention(keep, every, name, mode)
