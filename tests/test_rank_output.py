"""Ranks' plain `print` lines stay whole under `ddpkit run` and `ddpkit.spawn` (ddpkit.cluster.rank_output).

torchrun starts every rank with `python -u`, whose `print(a, b)` writes `a`, the separator, `b` and the
newline apart: with 4 ranks sharing one stdout, about 1 line in 6 came out torn before the ranks were
made line-buffered (1,446 of 8,000 in the run this test does). Checked both ways a rank starts under
`ddpkit run`: a new interpreter (the sitecustomize on PYTHONPATH) and forked from the warm-start server
(the test suite's default). The script imports nothing heavy, so a fresh rank starts in ~0.1 s.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from conftest import run_cli

import ddpkit
from ddpkit.names import WARM_START_ENV

LINES, WIDTH = 2000, 200
PRINTS = f"""
import os, sys
rank = int(os.environ["RANK"])
for i in range({LINES}):
    print(f"rank {{rank}} line {{i}}", "x" * {WIDTH})  # four writes under `python -u`
    print(f"rank {{rank}} error {{i}}", "y" * {WIDTH}, file=sys.stderr)
"""


def torn(text: str, kind: str, fill: str, ranks: int) -> list[str]:
    """The lines that are not one rank's whole line, and a line for each count that is off."""
    lines = text.splitlines()
    pattern = re.compile(rf"rank (\d) {kind} (\d+) {fill}{{{WIDTH}}}")
    whole = [m for m in map(pattern.fullmatch, lines) if m]
    bad = [line[:80] for line in lines if not pattern.fullmatch(line) and "ddpkit run: warning" not in line]
    counts = {r: sum(m.group(1) == str(r) for m in whole) for r in range(ranks)}
    return bad + [f"rank {r}: {n} whole {kind} lines of {LINES}" for r, n in counts.items() if n != LINES]


@pytest.mark.parametrize("start", ["warm", "fresh"])
def test_four_ranks_plain_print_lines_stay_whole(tmp_path: Path, start: str) -> None:
    script = tmp_path / "prints.py"
    script.write_text(PRINTS)
    env = {WARM_START_ENV: ""} if start == "fresh" else None  # "": new interpreters, as a user's run
    done = run_cli("run", "--nproc", "4", "--device", "cpu", str(script), timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert torn(done.stdout, "line", "x", 4) == []
    assert torn(done.stderr, "error", "y", 4) == []


def _prints(count: int) -> int:
    rank = int(__import__("os").environ["RANK"])
    for i in range(count):
        print(f"rank {rank} line {i}", "x" * WIDTH)
    sys.stdout.flush()
    return rank


def test_spawned_ranks_are_line_buffered(capfd: pytest.CaptureFixture[str]) -> None:
    """ddpkit.spawn's forked ranks (their stdout a block buffer otherwise, flushed every 8 KiB)."""
    assert ddpkit.spawn(_prints, nproc=2, args=(LINES,), start_method="fork", timeout=120) == [0, 1]
    assert torn(capfd.readouterr().out, "line", "x", 2) == []
