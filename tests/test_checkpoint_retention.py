"""Retention: the newest K, every Nth, the best by a metric; never the checkpoint just written (one
process, real files; the same rule prunes a remote store, tests/test_checkpoint_remote.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn

import ddpkit

HW = ddpkit.Hardware(gpus=0, cpu_cores=2)


def _steps(root: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in root.glob("ckpt-*"))


def test_the_newest_k_every_nth_and_the_best_are_kept(tmp_path: Path) -> None:
    model = nn.Linear(4, 4)
    losses = {1: 0.9, 2: 0.5, 3: 0.1, 4: 0.7, 5: 0.6, 6: 0.8, 7: 0.75}  # the best (lowest) at step 3
    with ddpkit.session(env={}, hardware=HW, verbose=False) as s:
        for step, loss in losses.items():
            s.save(
                tmp_path, model=model, step=step, val_loss=loss, keep=2, keep_every=4, keep_best="val_loss"
            )
            assert _steps(tmp_path)[-1] == step, "the checkpoint just written was deleted"
    assert _steps(tmp_path) == [3, 4, 6, 7]  # best 3, every 4th (4), newest two (6, 7); seq == step here
    with ddpkit.session(env={}, hardware=HW, verbose=False) as s:
        assert s.load(tmp_path / "ckpt-000003", model=model, step=0)["val_loss"] == 0.1


def test_keep_best_by_the_highest_and_keep_one_keeps_the_newest(tmp_path: Path) -> None:
    model = nn.Linear(4, 4)
    with ddpkit.session(env={}, hardware=HW, verbose=False) as s:
        for step, acc in enumerate([0.2, 0.9, 0.4, 0.3], start=1):
            s.save(tmp_path, model=model, step=step, acc=acc, keep=1, keep_best=("acc", "max"))
    assert _steps(tmp_path) == [2, 4]


def test_retention_mistakes_are_refused_with_their_fix(tmp_path: Path) -> None:
    model = nn.Linear(4, 4)
    with ddpkit.session(env={}, hardware=HW, verbose=False) as s:
        with pytest.raises(ddpkit.DdpkitError, match=r"keep_best='val_loss' needs a number named 'val_loss'"):
            s.save(tmp_path, model=model, step=1, keep_best="val_loss")
        with pytest.raises(ddpkit.DdpkitError, match=r"keep_every=0 is not a whole number"):
            s.save(tmp_path, model=model, step=1, keep_every=0)
    assert not list(tmp_path.iterdir())  # refused before anything was written
