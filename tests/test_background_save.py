"""Background saves: the state is copied before the call returns, and a crash in the middle of the
write leaves the previous checkpoint the newest valid one (real processes, a real SIGKILL)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from torch import nn

import ddpkit

HW = ddpkit.Hardware(gpus=0, cpu_cores=2)


def test_a_background_save_holds_the_state_of_the_call_not_of_later_steps(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with ddpkit.session(env={}, hardware=HW, verbose=False) as s:
        path = s.save(tmp_path, model=model, optimizer=opt, step=1, background=True)
        with torch.no_grad():  # training goes on while the write is in flight
            for p in model.parameters():
                p.add_(1.0)
        s.checkpoints.wait()
        assert path == tmp_path / "ckpt-000001" and (path / "manifest.json").is_file()
        fresh = nn.Linear(64, 64)
        assert (
            s.load(tmp_path, model=fresh, optimizer=torch.optim.AdamW(fresh.parameters()), step=0)["step"]
            == 1
        )
    for key, value in want.items():
        assert fresh.state_dict()[key].equal(value), f"{key}: the save holds a later state"


JOB = """
import os, signal, sys, torch, ddpkit
from torch import nn
root = sys.argv[1]
with ddpkit.session(seed=0, strategy=sys.argv[3]) as s:
    model = s.model(nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)]))  # 8 MiB: a write takes a while
    opt = torch.optim.AdamW(model.parameters())
    values = s.load(root, model=model, optimizer=opt, step=0)
    if sys.argv[2] == "crash":
        s.save(root, model=model, optimizer=opt, step=1)
        s.save(root, model=model, optimizer=opt, step=2, background=True)
        if s.rank == 0:  # the committing rank dies while its write is in flight
            os.kill(os.getpid(), signal.SIGKILL)
        s.checkpoints.wait()
    print("STEP", values["step"], flush=True)
"""


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])  # fsdp: DCP's async_save writes the shards
def test_a_crash_during_a_background_write_leaves_the_previous_checkpoint(
    tmp_path: Path, strategy: str
) -> None:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB))
    root = tmp_path / "ck"
    crashed = run_cli("run", "--nproc", "2", str(script), str(root), "crash", strategy, timeout=100)
    assert crashed.returncode != 0 and "SIGKILL" in crashed.stderr, crashed.stderr[-2000:]
    assert (root / "ckpt-000001").is_dir() and not (root / "ckpt-000002").exists()
    assert (root / ".ckpt-000002.tmp").is_dir(), "the background write was not in flight"
    resumed = run_cli("run", "--nproc", "2", str(script), str(root), "load", strategy, timeout=100)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "ignored .ckpt-000002.tmp: a save that never finished" in resumed.stdout, resumed.stdout
    assert "resumed from" in resumed.stdout and "ckpt-000001 (step 1)" in resumed.stdout
    assert "STEP 1" in resumed.stdout


def test_an_fsdp_background_save_is_the_state_of_the_call(pool2, tmp_path: Path) -> None:
    from fsdp_train import background_save_and_load

    for result in pool2.run(background_save_and_load, str(tmp_path / "ck")):
        assert result["async"], "the shards were not handed to DCP's async_save"
        assert result["changed_after"], "training did not go on while the write was in flight"
        assert result["differ"] == [], result["differ"]  # loaded == the state at the call, bitwise


def test_the_writer_thread_runs_at_idle_priority() -> None:
    """It takes no CPU time from training ranks that fill the cores (ddpkit.checkpoint_background)."""
    import os

    from ddpkit.checkpoint_background import Background

    writer = Background()
    writer.run(lambda: os.sched_getscheduler(0))  # 0: the calling thread, here the writer
    writer.wait()
    assert writer.result == os.SCHED_IDLE
    assert os.sched_getscheduler(0) != os.SCHED_IDLE  # the training thread keeps its priority
