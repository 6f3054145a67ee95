"""The embedded demo, end to end, as `ddpkit demo` runs it: 2 gloo ranks on real digits, its output in a
log file as a batch system keeps it (progress in plain lines there; tests/test_progress.py has the terminal)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from conftest import communicate, popen_cli
from test_progress import LINE


@pytest.mark.timeout(260)  # above the subprocess's 240 s
def test_demo_trains_to_95_percent_with_two_ranks_logging_plain_progress_lines(tmp_path: Path) -> None:
    log = tmp_path / "demo.log"
    with log.open("w") as f:  # stdout and stderr in one file, as `> log 2>&1`, Slurm or Kubernetes keep them
        proc, mark = popen_cli(
            "demo", "--out", str(tmp_path / "out"), cwd=tmp_path, stdout=f, stderr=subprocess.STDOUT
        )
        done = communicate(proc, mark, timeout=240)
    out = log.read_text()
    assert done.returncode == 0, out[-3000:]
    assert "mode ddp-cpu, world size 2" in out
    assert "global batch 64 = 32 per rank x 2 rank(s)" in out
    assert len(re.findall(r"^epoch \d+: train loss", out, re.M)) == 12, "one line per epoch, rank 0 only"
    accuracy = float(re.search(r"demo: ([\d.]+)% test accuracy in [\d.]+ s on 2 rank", out).group(1))
    assert accuracy >= 95.0
    png = tmp_path / "out" / "loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # In a log file, plain progress lines rather than tqdm's carriage-return refreshes
    assert "\r" not in out, "no carriage-return refreshes in a log file"
    lines = [m for m in map(LINE.match, out.splitlines()) if m]
    steps = [int(m.group(1)) for m in lines]
    assert 5 <= len(lines) <= 15 and steps == sorted(steps), f"about one line per tenth of the run: {steps}"
    assert steps[-1] == int(lines[-1].group(2)) == 12 * 23, (
        "the last step is always printed (12 epochs of 23)"
    )
