"""Progress in a log file: with stdout and stderr in a file (Slurm, Kubernetes, `> log 2>&1`), fit and
the demo print plain progress lines, not tqdm's carriage-return refreshes; on a terminal, the bar."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pty
import re
import struct
import termios
import threading
import time

LINE = re.compile(
    r"^fit: step (\d+)/(\d+) \(\d+%\), epoch \d+, loss [\d.e+-]+, \d+ samples/s, [\d.]+ ms/step, "
    r"[\d.]+ [TGM]?FLOP/s, MFU [\d.]+% \(measured peak\), \d+ s left$"
)  # issue 33: FLOP/s and MFU against the CPU's measured matmul peak


def _drain(fd: int, chunks: list[bytes]) -> None:
    """Read a pseudo-terminal's leader side until its follower side is closed (EIO) or ends."""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)


def test_on_a_terminal_the_bar_refreshes_in_place() -> None:
    """The control of tests/test_demo.py's log file (plain lines there): `fit`, the demo's loop, with stdout
    and stderr on a pseudo-terminal draws tqdm's bar (carriage returns). In this process: `fit` decides
    from sys.stdout and sys.stderr, as the demo's does from its terminal."""
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import TensorDataset

    import ddpkit
    from ddpkit.training.fit import fit

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # 120 columns for the bar
    chunks: list[bytes] = []
    reader = threading.Thread(target=_drain, args=(leader, chunks), daemon=True)  # the pty never fills
    reader.start()
    terminal = os.fdopen(follower, "w", buffering=1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as one rank of the demo: a tiny model on two threads crawls under load
    hardware = ddpkit.Hardware(gpus=0, cpu_cores=2)
    try:
        with (
            contextlib.redirect_stdout(terminal),
            contextlib.redirect_stderr(terminal),
            ddpkit.session(env={}, hardware=hardware, seed=0, verbose=False) as s,
        ):
            model = s.model(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            data = TensorDataset(torch.randn(256, 16), torch.randint(0, 4, (256,)))
            fit(
                s,
                model,
                opt,
                s.loader(data, batch_size=32),
                lambda m, b: F.cross_entropy(m(b[0]), b[1]),
                epochs=1,
            )
    finally:
        torch.set_num_threads(threads)
        terminal.close()  # the follower side: the reader sees the terminal close
        reader.join(30)
        os.close(leader)
    assert not reader.is_alive()
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
