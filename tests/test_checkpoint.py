"""Checkpoint files: atomic, verified, pickle-free. One process (world size 1), real files, no mocks."""

from __future__ import annotations

import json
import math
import os
import pickle
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import ddpkit
from ddpkit.checkpoint import checkpoints as checkpoint
from ddpkit.checkpoint import files
from ddpkit.checkpoint.files import CheckpointError

HW = ddpkit.Hardware(gpus=0, cpu_cores=2)


def _objects() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    return model, opt


def _save_steps(root: Path, steps: list[int], **kw) -> list[Path]:
    model, opt = _objects()
    with ddpkit.session(env={}, hardware=HW, verbose=False) as s:
        return [s.save(root, model=model, optimizer=opt, step=step, **kw) for step in steps]


def _load(path: Path, verbose: bool = True) -> dict:
    model, opt = _objects()
    with ddpkit.session(env={}, hardware=HW, verbose=verbose) as s:
        return s.load(path, model=model, optimizer=opt, step=-1)


def test_round_trip_restores_objects_values_and_rng(tmp_path: Path) -> None:
    model, opt = _objects()
    with ddpkit.session(env={}, hardware=HW, verbose=False) as s:
        s.save(tmp_path, model=model, optimizer=opt, step=7, best=float("nan"), tags=("a", 1), sizes={1: 2.5})
        fresh = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
        values = s.load(tmp_path, model=fresh, optimizer=fresh_opt, step=0, other="default")
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert fresh_opt.state_dict()["param_groups"][0]["lr"] == 0.1
    assert fresh_opt.state_dict()["param_groups"][0]["betas"] == (0.9, 0.999)  # tuples stay tuples
    for a, b in zip(
        opt.state_dict()["state"].values(), fresh_opt.state_dict()["state"].values(), strict=True
    ):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert values["step"] == 7 and math.isnan(values["best"]) and values["tags"] == ("a", 1)
    assert values["sizes"] == {1: 2.5} and values["other"] == "default"


def test_rng_streams_continue_where_they_were_saved(tmp_path: Path) -> None:
    with ddpkit.session(env={}, hardware=HW, verbose=False) as s:
        s.save(tmp_path, step=1)
        want = (torch.rand(3), np.random.rand(), __import__("random").random())
        s.load(tmp_path)
        got = (torch.rand(3), np.random.rand(), __import__("random").random())
    assert torch.equal(want[0], got[0]) and want[1:] == got[1:]


def test_keep_last_k_and_fresh_start(tmp_path: Path, capsys) -> None:
    assert _load(tmp_path / "none") == {"step": -1}
    assert "no checkpoint in" in capsys.readouterr().out
    paths = _save_steps(tmp_path, [1, 2, 3, 4], keep=2)
    assert [p.name for p in paths] == ["ckpt-000001", "ckpt-000002", "ckpt-000003", "ckpt-000004"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000003", "ckpt-000004"]
    assert checkpoint.latest(tmp_path) == paths[-1] and _load(tmp_path)["step"] == 4


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


DAMAGE = {
    "truncated weights": ("model.safetensors", lambda p: p.write_bytes(p.read_bytes()[:-9]), "truncated"),
    "flipped byte in weights": ("model.safetensors", lambda p: _flip(p, p.stat().st_size - 3), "SHA-256"),
    "flipped byte in optimizer": ("state.json", lambda p: _flip(p, 10), "SHA-256"),
    "flipped byte in RNG": ("rank-00000.safetensors", lambda p: _flip(p, p.stat().st_size // 2), "SHA-256"),
    "truncated manifest": ("manifest.json", lambda p: p.write_bytes(p.read_bytes()[:40]), "damaged"),
    "missing file": ("state.safetensors", lambda p: p.unlink(), "missing"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damage_is_detected_and_the_newest_valid_checkpoint_is_chosen(
    tmp_path: Path, capsys, damage: str
) -> None:
    name, harm, words = DAMAGE[damage]
    _, newest = _save_steps(tmp_path, [1, 2])
    harm(newest / name)
    capsys.readouterr()
    assert _load(tmp_path)["step"] == 1  # "resume from latest" falls back
    out = capsys.readouterr().out
    assert f"skipped a damaged checkpoint: {newest}" in out and words in out, out
    with pytest.raises(CheckpointError, match=words):
        _load(newest)  # asking for that one is an error naming the file


def test_every_checkpoint_damaged_is_an_error_not_a_fresh_start(tmp_path: Path) -> None:
    (only,) = _save_steps(tmp_path, [1])
    _flip(only / "model.safetensors", 100)
    with pytest.raises(CheckpointError, match=r"(?s)every checkpoint in .* is damaged.*delete the folder"):
        _load(tmp_path)


class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['PWNED_MARKER']}",))


def test_a_planted_pickle_is_refused_without_running(tmp_path: Path, capsys, monkeypatch) -> None:
    marker = tmp_path / "pwned"
    monkeypatch.setenv("PWNED_MARKER", str(marker))
    (good,) = _save_steps(tmp_path / "ck", [1])
    evil = tmp_path / "ck" / "ckpt-000002"  # newer, complete, with checksums that match the pickle
    evil.mkdir()
    for f in good.iterdir():
        (evil / f.name).write_bytes(f.read_bytes())
    (evil / "model.safetensors").write_bytes(pickle.dumps(_Payload()))
    for stray in (evil / "model.pt", tmp_path / "ck" / "model.pt"):
        stray.write_bytes(pickle.dumps(_Payload()))
    manifest = json.loads((evil / "manifest.json").read_text())
    manifest["files"] = {
        p.name: {"bytes": p.stat().st_size, "sha256": files.sha256_of(p)}
        for p in evil.iterdir()
        if p.name != "manifest.json"
    }
    files.write_manifest(evil, {k: v for k, v in manifest.items() if k not in ("format", "self_sha256")})
    assert _load(tmp_path / "ck")["step"] == 1
    assert "not a safetensors file" in capsys.readouterr().out
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        _load(evil)
    assert not marker.exists(), "the pickle ran"


CRASH_SCRIPT = """
import os, signal, sys
import torch, ddpkit
from ddpkit.checkpoint import files as checkpoint_files

root = sys.argv[1]
model = torch.nn.Linear(2, 2)
with ddpkit.session(env={}, verbose=False) as s:
    s.save(root, model=model, step=1)
    real = checkpoint_files.write_tensors

    def half_then_die(path, tensors):
        real(path, tensors)
        data = open(path, "rb").read()
        open(path, "wb").write(data[: len(data) // 2])
        os.kill(os.getpid(), signal.SIGKILL)   # a real crash, in the middle of the second save

    checkpoint_files.write_tensors = half_then_die
    s.save(root, model=model, step=2)
"""


def test_a_crash_in_the_middle_of_a_save_leaves_the_previous_checkpoint_chosen(tmp_path: Path) -> None:
    script = tmp_path / "crash.py"
    script.write_text(textwrap.dedent(CRASH_SCRIPT))
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ck")], capture_output=True, timeout=60
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    names = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert names == [".ckpt-000002.tmp", "ckpt-000001"]  # the half-written one never got its final name
    assert checkpoint.latest(tmp_path / "ck") == tmp_path / "ck" / "ckpt-000001"
    model = nn.Linear(2, 2)
    with ddpkit.session(env={}, hardware=HW, verbose=False) as s:
        assert s.load(tmp_path / "ck", model=model)["step"] == 1
        s.save(tmp_path / "ck", model=model, step=3)  # the next save cleans the debris up
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["ckpt-000001", "ckpt-000003"]


def test_clear_errors_for_what_cannot_be_saved_or_loaded(tmp_path: Path) -> None:
    with ddpkit.session(env={}, hardware=HW, verbose=False) as s:
        with pytest.raises(
            ddpkit.DdpkitError, match=r"cannot save values/fn of type builtin_function_or_method.*no pickle"
        ):
            s.save(tmp_path, fn=len)
        s.save(tmp_path, model=nn.Linear(2, 2), step=1)
        with pytest.raises(ddpkit.DdpkitError, match=r"has no optimizer \(it holds model, step\)"):
            s.load(tmp_path, model=nn.Linear(2, 2), optimizer=torch.optim.SGD(nn.Linear(1, 1).parameters()))
        with pytest.raises(ddpkit.DdpkitError, match=r"is a checkpoint, not a folder of checkpoints"):
            s.save(tmp_path / "ckpt-000001", step=2)
        with pytest.raises(ddpkit.DdpkitError, match=r"keep=0 would delete"):
            s.save(tmp_path, keep=0)
