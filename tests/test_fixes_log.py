"""`fit(log=...)`: a resumed run appends to the log, whose rows of the run it continues stay (JSON lines and
CSV); a fresh run empties it. One process: the log is global rank 0's alone."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit


def _rows(log: Path) -> list[dict]:
    if log.suffix == ".csv":
        with log.open(newline="") as f:
            return list(csv.DictReader(f))
    return [json.loads(line) for line in log.read_text().splitlines()]


def _run(log: Path, ckpt: Path, steps: int, resume: bool) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(32, 4, generator=g)
    with ddpkit.session(seed=0, verbose=False, log_to=None) as s:
        model = s.model(nn.Linear(4, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = s.loader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=8)
        things = {"model": model, "optimizer": opt, "stepper": s.stepper, "loader": loader}
        if resume:
            s.load(str(ckpt), **things)
        step = lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1])  # noqa: E731
        ddpkit.fit(s, model, opt, loader, step, max_steps=steps, log=str(log), progress=False, flops=None)
        s.save(str(ckpt), **things)


@pytest.mark.parametrize("suffix", ["jsonl", "csv"])
def test_a_resumed_run_appends_to_the_log_and_a_fresh_one_empties_it(tmp_path: Path, suffix: str) -> None:
    log, ckpt = tmp_path / f"log.{suffix}", tmp_path / "ckpt"
    _run(log, ckpt, steps=3, resume=False)
    first = _rows(log)
    assert [int(r["step"]) for r in first] == [1, 2, 3]
    _run(log, ckpt, steps=2, resume=True)
    rows = _rows(log)
    assert rows[:3] == first, "the first run's rows are gone after the resume"
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 1, 2]  # each call counts its own steps
    _run(log, tmp_path / "other", steps=2, resume=False)  # a fresh run writing to the same log
    assert [int(r["step"]) for r in _rows(log)] == [1, 2]
