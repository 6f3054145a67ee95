"""`background="process"`: a writer process writes and hashes the big files from shared memory.

What a user checks: the checkpoint is the state of the call (training goes on meanwhile) and the same
bytes a synchronous save writes; the bytes were written by another process, at idle priority; a writer
process killed mid-save fails that save clearly, loses no earlier checkpoint, and the next save works.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import ddpkit
from ddpkit.checkpoint.checkpoints import latest
from ddpkit.checkpoint.files import CheckpointError

HW = ddpkit.Hardware(gpus=0, cpu_cores=2)

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="the writer process needs Linux")


def _read(path: str) -> str:
    """A /proc file, or "" when its thread or process ended between the listing and the read."""
    try:
        return Path(path).read_text()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def _children() -> list[int]:
    # A thread of this process (torch's, a checkpoint waiter's) can end between iterdir and the read.
    kids: list[int] = []
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        kids += [int(k) for k in _read(f"{task}/children").split()]
    return kids


def _writer_pid() -> int:
    kids = [k for k in _children() if "writer_child.py" in _read(f"/proc/{k}/cmdline")]
    assert len(kids) == 1, kids
    return kids[0]


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    return model, opt


def _manifest(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def test_a_process_save_is_the_state_of_the_call_and_the_bytes_of_a_synchronous_save(tmp_path: Path) -> None:
    model, opt = _trained()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with ddpkit.session(env={}, hardware=HW, verbose=False) as s:
        sync = s.save(tmp_path / "sync", model=model, optimizer=opt, step=1)
        path = s.save(tmp_path / "proc", model=model, optimizer=opt, step=1, background="process")
        with torch.no_grad():  # training goes on while the write is in flight
            for p in model.parameters():
                p.add_(1.0)
        s.checkpoints.wait()
        writer = _writer_pid()
        assert os.sched_getscheduler(writer) == os.SCHED_IDLE  # CPU time training leaves idle
        assert os.sched_getscheduler(0) != os.SCHED_IDLE
        # the bytes left through the writer process, not through this one
        written = int(
            dict(line.split(": ") for line in Path(f"/proc/{writer}/io").read_text().splitlines())["wchar"]
        )
        assert (
            written
            >= (path / "model.safetensors").stat().st_size + (path / "state.safetensors").stat().st_size
        )
        a, b = _manifest(sync)["files"], _manifest(path)["files"]
        for name in ("model.safetensors", "state.safetensors", "state.json"):
            assert a[name] == b[name], f"{name}: not the bytes a synchronous save writes"
        fresh = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 64))
        step = s.load(tmp_path / "proc", model=fresh, optimizer=torch.optim.AdamW(fresh.parameters()), step=0)
        assert step["step"] == 1
        # a second save reuses the shared memory of the first (no new segments)
        before = s.checkpoints._process.arena.nbytes()
        s.save(tmp_path / "proc", model=model, optimizer=opt, step=2, background="process")
        s.checkpoints.wait()
        assert s.checkpoints._process.arena.nbytes() == before
    for key, value in want.items():
        assert fresh.state_dict()[key].equal(value), f"{key}: the save holds a later state"
    assert not [k for k in _children() if "writer_child.py" in _read(f"/proc/{k}/cmdline")]


def test_a_killed_writer_process_fails_its_save_and_loses_no_earlier_checkpoint(tmp_path: Path) -> None:
    model, opt = _trained()
    root = tmp_path / "ck"
    with ddpkit.session(env={}, hardware=HW, verbose=False) as s:
        s.save(root, model=model, optimizer=opt, step=1, background="process")
        s.checkpoints.wait()
        writer = _writer_pid()
        os.kill(writer, signal.SIGSTOP)  # the next write is held in flight...
        s.save(root, model=model, optimizer=opt, step=2, background="process")
        time.sleep(0.2)
        os.kill(writer, signal.SIGKILL)  # ...and the writer dies in the middle of it
        with pytest.raises(
            CheckpointError,
            match=r"writer process .* ended \(killed by signal 9\).*previous "
            r"checkpoint is untouched",
        ):
            s.checkpoints.wait()
        assert (root / "ckpt-000001").is_dir() and not (root / "ckpt-000002").exists()
        assert latest(root) == root / "ckpt-000001"
        assert not list(root.glob(".ckpt-*")), "the failed save's partial files were left behind"
        fresh = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 64))
        assert s.load(root, model=fresh, step=0)["step"] == 1
        # the next save starts a new writer and commits
        path = s.save(root, model=model, optimizer=opt, step=3, background="process")
        s.checkpoints.wait()
        assert _writer_pid() != writer
        assert path == root / "ckpt-000002" and s.load(root, model=fresh, step=0)["step"] == 3


def test_an_unknown_background_mode_is_refused_with_the_choices(tmp_path: Path) -> None:
    model, _ = _trained()
    with (
        ddpkit.session(env={}, hardware=HW, verbose=False) as s,
        pytest.raises(ddpkit.DdpkitError, match=r"background='proc' is not a way to save.*\"process\""),
    ):
        s.save(tmp_path, model=model, step=1, background="proc")
