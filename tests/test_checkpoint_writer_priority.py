"""A background save's work runs on CPU time training leaves idle: the threads it starts in a training
process (the writer, and the gloo workers of its own process group, which carry the optimizer shares
to rank 0) run at the lowest priority (SCHED_IDLE), and the checkpoint is whole. Real gloo ranks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

import ddpkit

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")


def _threads() -> dict[int, tuple[str, int]]:
    """This process's threads: id -> (name, scheduling policy)."""
    out = {}
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(task.name)] = (stat[stat.index("(") + 1 : stat.rindex(")")], int(fields[38]))
    return out


def save_in_background(root: str, mode: str) -> tuple[list[tuple[str, int]], int]:
    """Rank r: a background save with a sharded optimizer step's state; the threads the save started
    that are still there after it (name, policy), and the step the checkpoint resumes."""
    with ddpkit.session(seed=0, verbose=False) as s:
        model = s.model(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8)))
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        s.backward(model(torch.randn(4, 64)).sum())
        s.step(opt)
        before = _threads()
        s.save(root, model=model, optimizer=opt, step=1, background=mode)
        s.checkpoints.wait()
        started = [v for tid, v in _threads().items() if tid not in before]
        step = s.load(root, model=model, optimizer=opt, step=0)["step"]
    return started, step


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["thread", "process"])
def test_the_threads_a_background_save_starts_run_at_the_lowest_priority(
    pool2, tmp_path: Path, mode: str
) -> None:
    for started, step in pool2.run(save_in_background, str(tmp_path / "ckpt"), mode):
        assert step == 1
        assert started, "no thread of the writer's process group found"  # gloo's workers stay for the session
        assert all(policy == os.SCHED_IDLE for _, policy in started), (
            f"threads of a background save at training's priority: {started}"
        )
