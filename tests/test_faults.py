"""Faults under `ddpkit run`: a killed rank, a stalled rank, a raising rank, Ctrl-C, a slow save, the exit.

Every test starts real processes through torchrun's agent and is bounded by a timeout. The restart test
compares against the uninterrupted run of `resume_train.train` in the rank pool (same code, same world
size, same thread count), so it also shows that launching through torchrun changes nothing.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, python, run_cli
from resume_train import reference, same

from ddpkit.cluster import lifecycle

TRAIN = str(REPO / "tests" / "resume_train.py")


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(body))
    return path


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@pytest.mark.timeout(170)  # above torchrun's 150 s below
@pytest.mark.parametrize("position", [True, False], ids=["exact", "negative-control-without-position"])
def test_a_killed_rank_is_restarted_and_the_run_ends_like_an_uninterrupted_one(
    pool2, tmp_path: Path, position: bool
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    args = ["--every", "3", "--kill-at", "14"] + ([] if position else ["--no-position"])
    start = time.monotonic()
    done = run_cli(
        "run",
        "--nproc",
        "2",
        "--max-restarts",
        "1",
        TRAIN,
        str(tmp_path / "ck"),
        str(out),
        *args,
        timeout=150,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # What the user needs: the rank that died named, with how it died, whichever rank exited first
    # (ddpkit's restart line orders a killed rank before the peers that noticed it; run_report.py).
    assert re.search(r"restart 1 of 1: rank 1 \(local rank 1 .*killed by SIGKILL", done.stderr), (
        f"the restart line does not name rank 1 killed by SIGKILL:\n{done.stderr[-3000:]}"
    )
    assert (out / "killed.txt").exists(), "rank 1 was not killed"
    assert "resumed from" in done.stdout and "(step 12)" in done.stdout, done.stdout
    killed_at, killed_step = (out / "killed.txt").read_text().split()
    resumed_at, resumed_step = (out / "resumed.txt").read_text().split()
    want = reference(pool2)
    for rank in (0, 1):
        got = torch.load(out / f"rank{rank}.pt", weights_only=True)
        diff = same(got, {k: v for k, v in want[rank].items() if k != "seen"})
        if position:
            assert diff == [], f"rank {rank} differs from the uninterrupted run at {diff}"
        else:
            assert "/model/0.weight" in diff, "without the data position the run should differ"
    print(
        f"\nkill -9 at step {killed_step} -> training again from step {resumed_step} after "
        f"{float(resumed_at) - float(killed_at):.1f} s (whole job {time.monotonic() - start:.1f} s)"
    )


STALL = """
import time, ddpkit
with ddpkit.session(timeout=3, verbose=False) as s:
    s.all_reduce(1.0)
    if s.rank == 1:
        time.sleep(60)  # the stall: rank 1 never comes to the next collective
    s.all_reduce(2.0)
"""


def test_a_stalled_rank_fails_the_job_within_the_timeout_and_is_named(tmp_path: Path) -> None:
    script = _script(tmp_path, STALL)
    start = time.monotonic()
    done = run_cli("run", "--nproc", "2", str(script), timeout=90)
    elapsed = time.monotonic() - start
    assert done.returncode == 1, done.stderr[-3000:]
    culprit = (
        r"rank 1 did not reach the collective that rank 0 waits in \(all_reduce, at job.py:7\): "
        r"rank 1 is at \S*job.py:6 in <module>: time.sleep\(60\)"
    )
    assert re.search(rf"DdpkitError: {culprit}", done.stderr), done.stderr[-3000:]  # the error's first line
    assert re.search(
        r"rank 1: running \(not in a collective\) at .*job.py:6 in <module>: time.sleep\(60\)", done.stderr
    ), done.stderr[-3000:]
    assert re.search(r"rank 0: in all_reduce at .*job.py:7 in <module>: s.all_reduce\(2.0\)", done.stderr)
    assert re.match(rf"ddpkit run: {culprit}.*\. Then rank 0 .* timed out", _headline(done.stderr)), (
        done.stderr
    )
    # ended by the 3 s collective timeout, not by rank 1's 60 s sleep (start-up under load varies: no tight bound)
    assert elapsed < 55, f"took {elapsed:.0f} s"


def _headline(stderr: str) -> str:
    heads = [line for line in stderr.splitlines() if line.startswith("ddpkit run:")]
    assert len(heads) == 1, stderr[-3000:]
    return heads[0]


# Rank 0 waits in a collective DDP issues itself, from C++ (the bucket rebuild in the second forward):
# no torch.distributed function is on its stack. The timeout (8 s) is far above a step's time under load.
DDP_STALL = """
import time, torch, ddpkit
from torch import nn
with ddpkit.session(timeout=8, verbose=False) as s:
    model = s.model(nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        if s.rank == 1 and step == 1:
            time.sleep(120)
        s.backward(model(torch.randn(8, 4)).sum())
        s.step(opt)
"""


def test_a_rank_missing_from_ddps_own_collective_is_named_first(tmp_path: Path) -> None:
    script = _script(tmp_path, DDP_STALL)
    start = time.monotonic()
    done = run_cli("run", "--nproc", "2", str(script), timeout=120)
    elapsed = time.monotonic() - start
    assert done.returncode == 1, done.stderr[-3000:]
    culprit = (
        r"rank 1 did not reach the collective that rank 0 waits in \(DDP's forward: its bucket rebuild, "
        r"at job.py:10\): rank 1 is at \S*job.py:9 in <module>: time.sleep\(120\)"
    )
    assert re.search(rf"DdpkitError: {culprit}\n", done.stderr), done.stderr[-3000:]  # the error's first line
    assert re.match(rf"ddpkit run: {culprit}\. Then rank 0 .* timed out", _headline(done.stderr)), done.stderr
    assert re.search(r"rank 0: in DDP's forward: its bucket rebuild at \S*job.py:10 in <module>", done.stderr)
    assert elapsed < 100, f"took {elapsed:.0f} s"  # the sleeper is stopped when rank 0 fails, not after 120 s


BUDGET = """
import os, pathlib, ddpkit
with ddpkit.session(verbose=False) as s:
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    pathlib.Path(os.environ["OUT_DIR"], f"pid-{attempt}-{s.rank}").write_text(str(os.getpid()))
    s.all_reduce(1.0)
    if s.rank == 1:
        raise ValueError(f"bad batch on rank 1 (attempt {attempt})")
    s.all_reduce(2.0)  # rank 0 waits here for a peer that is gone
"""


def test_a_used_up_restart_budget_ends_with_one_report_and_no_orphans(tmp_path: Path) -> None:
    script = _script(tmp_path, BUDGET)
    start = time.monotonic()
    done = run_cli(
        "run", "--nproc", "2", "--max-restarts", "1", str(script), env={"OUT_DIR": str(tmp_path)}, timeout=120
    )
    assert done.returncode == 1
    restarts = [line for line in done.stderr.splitlines() if line.startswith("ddpkit run: restart")]
    reports = [
        line for line in done.stderr.splitlines() if line.startswith("ddpkit run:") and line not in restarts
    ]
    assert len(reports) == 1 and len(restarts) == 1, reports + restarts
    assert re.search(
        r"restart 1 of 1: rank 1 .* failed first with ValueError: bad batch on rank 1", restarts[0]
    )
    assert re.search(r"rank 1 .* failed first with (exit code 1|an exception)", reports[0]), reports[0]
    assert "ValueError: bad batch on rank 1 (attempt 1)" in reports[0]
    assert "The restart budget (--max-restarts 1) is used up" in reports[0]
    pids = [int(p.read_text()) for p in tmp_path.glob("pid-*")]
    assert len(pids) == 4, "two attempts of two ranks"
    assert not [pid for pid in pids if _alive(pid)], "orphaned rank processes"
    assert time.monotonic() - start < 110  # rank 0 was stopped, not left in its 1800 s collective wait


SLEEPER = """
import os, pathlib, time, ddpkit
with ddpkit.session(verbose=False) as s:
    s.all_reduce(1.0)
    pathlib.Path(os.environ["OUT_DIR"], f"pid-{s.rank}").write_text(str(os.getpid()))
    time.sleep(120)
"""


def test_ctrl_c_stops_every_rank(tmp_path: Path) -> None:
    script = _script(tmp_path, SLEEPER)
    env = {**os.environ, "OUT_DIR": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    # `ddpkit run` as the suite's warm client (tests/conftest.py, `python()`): it passes the SIGINT on to
    # the launcher it runs, forked from the warm server, as a terminal's Ctrl-C reaches `ddpkit run`
    proc = subprocess.Popen(
        [python(), "-m", "ddpkit.cli", "run", "--nproc", "2", str(script)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("pid-*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = [int(p.read_text()) for p in tmp_path.glob("pid-*")]
        assert len(pids) == 2, "the ranks never started"
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=100)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGINT, err[-2000:]
    assert "ddpkit run: stopped by SIGINT; every rank was signalled and has exited." in err
    assert not [pid for pid in pids if _alive(pid)], "a rank outlived Ctrl-C"
    assert time.monotonic() - start < 100  # the ranks were stopped, not left in their 120 s sleep


FINISHES = """
import sys, threading, time, torch, ddpkit
from ddpkit.checkpoint import files as checkpoint_files

with ddpkit.session(timeout=2, save_timeout=60, verbose=False) as s:
    if s.rank == 0:  # rank 0's disk is slower than the 2 s collective timeout
        real = checkpoint_files.write_manifest
        checkpoint_files.write_manifest = lambda *a: (time.sleep(4), real(*a))
    s.save(sys.argv[1], step=1)
    s.all_reduce(1.0)  # rank 1 waited in the store, not in a collective: nobody timed out
    print(f"rank {s.rank}: SAVED AND REDUCED")

# Threads that return from native code while the interpreter finalizes: without ddpkit's exit
# guard this ends in "terminate called without an active exception" (SIGABRT) every time.
a = torch.randn(300, 300)
for _ in range(2):
    threading.Thread(target=lambda: [a.mm(a) for _ in iter(int, 1)], daemon=True).start()
time.sleep(0.2)
"""


def test_a_finished_run_exits_zero_despite_a_slow_save_and_native_threads(tmp_path: Path) -> None:
    script = _script(tmp_path, FINISHES)
    done = run_cli("run", "--nproc", "2", str(script), str(tmp_path / "ck"), timeout=90)
    assert done.stdout.count("SAVED AND REDUCED") == 2, done.stderr[-3000:]
    assert "terminate called" not in done.stderr
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "ck" / "ckpt-000001" / "manifest.json").is_file()


def test_negative_control_native_threads_abort_a_plain_exit(tmp_path: Path) -> None:
    body = FINISHES.split("# Threads")[1].split("\n", 2)[2]
    script = _script(tmp_path, "import threading, time, torch\ntorch.set_num_threads(1)\n" + body)
    # run by the suite's warm client (a process forked from the warm server, torch imported): the same
    # interpreter exit, without a new interpreter's imports
    done = subprocess.run([python(), str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGABRT and "terminate called" in done.stderr, (
        done.returncode,
        done.stderr,
    )


@pytest.mark.parametrize(
    ("body", "zero"),
    [
        ("x = 1\n", True),
        ("if x:\n    y = 2\n", True),
        ("raise SystemExit(3)\n", False),
        ("sys.exit(0)\n", False),
    ],
)
def test_the_exit_guard_acts_only_when_the_exit_code_is_certainly_zero(body: str, zero: bool) -> None:
    scope = {"__name__": "__main__", "sys": sys, "x": 1}
    code = compile("import sys\nFRAME = sys._getframe()\n" + body, "<script>", "exec")
    with contextlib.suppress(SystemExit):
        exec(code, scope)
    assert lifecycle.finished_with_zero(scope["FRAME"]) is zero


@pytest.mark.parametrize("bad", ["rendezvous_timeout", "save_timeout", "timeout"])
def test_time_limits_are_validated_and_named(bad: str) -> None:
    from ddpkit import DdpkitError, session

    with pytest.raises(DdpkitError, match=rf"{bad}=0 seconds is not positive"), session(env={}, **{bad: 0}):
        pass
    assert lifecycle.Limits() == lifecycle.Limits(rendezvous=600.0, collective=1800.0, save=3600.0)
