"""The embedded demo, end to end, as `ddpkit demo` runs it: 2 gloo ranks on real digits."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import run_cli


@pytest.mark.timeout(260)  # above the subprocess's 240 s
def test_demo_trains_to_95_percent_with_two_ranks(tmp_path: Path) -> None:
    done = run_cli("demo", "--out", str(tmp_path / "out"), timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "mode ddp-cpu, world size 2" in out
    assert "global batch 64 = 32 per rank x 2 rank(s)" in out
    assert len(re.findall(r"^epoch \d+: train loss", out, re.M)) == 12, "one line per epoch, rank 0 only"
    accuracy = float(re.search(r"demo: ([\d.]+)% test accuracy in [\d.]+ s on 2 rank", out).group(1))
    assert accuracy >= 95.0
    png = tmp_path / "out" / "loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
