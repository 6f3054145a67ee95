"""Progress in a log file: with stdout and stderr in a file (Slurm, Kubernetes, `> log 2>&1`), fit and
the demo print plain progress lines, not tqdm's carriage-return refreshes; on a terminal, the bar."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
from conftest import REPO

LINE = re.compile(
    r"^fit: step (\d+)/(\d+) \(\d+%\), epoch \d+, loss [\d.e+-]+, \d+ samples/s, [\d.]+ ms/step, "
    r"[\d.]+ [TGM]?FLOP/s, MFU [\d.]+% \(measured peak\), \d+ s left$"
)  # issue 33: FLOP/s and MFU against the CPU's measured matmul peak


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}


def test_on_a_terminal_the_bar_refreshes_in_place(tmp_path: Path) -> None:
    """The control of tests/test_demo.py's log file (plain lines there): the demo on a pseudo-terminal draws
    tqdm's bar (carriage returns)."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # 120 columns for the bar
    proc = subprocess.Popen([sys.executable, "-m", "ddpkit.tools.demo", "--epochs", "1", "--out", str(tmp_path / "out")],
                            stdout=follower, stderr=follower, cwd=tmp_path, env=_env(), start_new_session=True)  # fmt: skip
    os.close(follower)
    chunks = []
    deadline = time.monotonic() + 100  # under pytest's 120 s; the demo and its ranks are killed first
    while True:
        if not select.select([leader], [], [], max(0.0, deadline - time.monotonic()))[0]:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"the demo did not finish in 100 s: {b''.join(chunks)[-2000:]!r}")
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the terminal closed: the process exited
            break
        if not chunk:
            break
        chunks.append(chunk)
    assert proc.wait(timeout=10) == 0
    text = b"".join(chunks).decode(errors="replace")
    assert re.search(r"\rfit: +\d+%", text), "tqdm redraws the bar in place (a carriage return, then the bar)"
    assert not any(LINE.match(x.strip()) for x in text.splitlines()), "and prints no plain progress line"
    assert "perf=" in text and "MFU" in text, "the bar's postfix shows FLOP/s and MFU (issue 33)"


def test_a_run_of_unknown_length_logs_a_line_every_every_s_seconds() -> None:
    """No total (an iterable without a length): no tenths to print at, so the lines come by time."""
    import io

    from ddpkit.observe.progress import Progress

    stream = io.StringIO()
    progress = Progress(None, every_s=0.05, stream=stream)
    for step in range(1, 7):
        time.sleep(0.06)  # each step longer than every_s: a line after each
        progress.update(step, 0, 0.5, 16)
    progress.close()
    steps = [int(m.group(1)) for m in re.finditer(r"^fit: step (\d+)", stream.getvalue(), re.M)]
    assert steps[:6] == [1, 2, 3, 4, 5, 6], stream.getvalue()
