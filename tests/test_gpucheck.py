"""The GPU acceptance command's CPU-side behaviour: skips cleanly without CUDA, and its harness works.

The checks themselves need a GPU (docs/gpu.md); DDPKIT_GPUCHECK_DEVICE=cpu rehearses the quick ones here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddpkit.tools import gpucheck

REPO = Path(__file__).resolve().parents[1]
needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the check runs")


@needs_no_cuda
def test_script_without_cuda_skips_with_the_reason_and_exit_0() -> None:
    env = {k: v for k, v in os.environ.items() if k != "DDPKIT_GPUCHECK_DEVICE"}
    out = subprocess.run(
        [str(REPO / "scripts" / "gpu-check.sh")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, "PYTHON": sys.executable},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "skipped: no CUDA device" in out.stdout and "Nothing was checked" in out.stdout


def test_list_and_unknown_names(capsys) -> None:
    assert gpucheck.main(["--list"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == list(gpucheck.CHECKS)
    assert {"demo", "fp16-scaler", "resume-bitwise", "shared-ddp", "verify-shared", "cuda-errors"} <= set(
        listed
    )
    assert gpucheck.main(["--only", "demo,nope"]) == 2


def test_rehearsal_on_cpu_one_line_per_check_and_summary(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("DDPKIT_GPUCHECK_DEVICE", "cpu")
    report = tmp_path / "r.json"
    code = gpucheck.main(
        [
            "--only",
            "auto-single-gpu,fp16-scaler,checkpoint-devices,syncbn-convert",
            "--keep",
            str(tmp_path),
            "--json",
            str(report),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    lines = [line for line in out.splitlines() if line[:4] in ("PASS", "FAIL", "SKIP")]
    assert [line.split()[:2] for line in lines] == [
        ["PASS", "auto-single-gpu"],
        ["PASS", "fp16-scaler"],
        ["PASS", "checkpoint-devices"],
        ["SKIP", "syncbn-convert"],
    ]
    assert "CUDA only" in lines[-1] and "3 passed, 0 failed, 1 skipped" in out and "ALL PASS" in out
    assert json.loads(report.read_text())["ok"] is True


def test_a_failing_check_fails_the_command(tmp_path, monkeypatch, capsys) -> None:
    def broken(ctx: gpucheck.Context) -> str:
        raise AssertionError("planted failure")

    monkeypatch.setenv("DDPKIT_GPUCHECK_DEVICE", "cpu")
    monkeypatch.setitem(gpucheck.CHECKS, "broken", broken)
    assert gpucheck.main(["--only", "auto-single-gpu,broken", "--keep", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "FAIL  broken" in out and "planted failure" in out and "1 passed, 1 failed" in out


@needs_no_cuda
def test_gpu_overhead_benchmark_skips_without_cuda() -> None:
    out = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_overhead.py")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and "skipped: no CUDA device" in out.stdout, out.stdout + out.stderr
