"""Shared fixtures: long-lived rank pools, environment hygiene, helpers to run the CLI."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from rankpool import RankPool

REPO = Path(__file__).resolve().parent.parent

_pools: dict[int, RankPool] = {}


def _pool(world: int) -> RankPool:
    if world not in _pools:
        _pools[world] = RankPool(world)
    return _pools[world]


@pytest.fixture(scope="session")
def pool2() -> RankPool:
    """Two gloo ranks shared by every test that asks (one process group for the whole run)."""
    return _pool(2)


@pytest.fixture(scope="session")
def pool3() -> RankPool:
    return _pool(3)


@pytest.fixture(scope="session")
def pool4() -> RankPool:
    """Four gloo ranks (oversubscribed on 2 cores): world sizes 1, 2 and 4 through subgroups."""
    return _pool(4)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    for pool in _pools.values():
        pool.close()


REQUIRED = "DDPKIT_CI_REQUIRE"  # e.g. "elastic,cgroup": tests marked must_run(name) may not skip


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A skip of a test that the environment declares required is a failure, with the skip's reason.

    Some proofs need what only some machines have (root, network namespaces, a memory cgroup); they skip
    elsewhere. CI names the ones its machine must run, so losing one fails CI instead of passing quietly.
    """
    outcome = yield
    report = outcome.get_result()
    required = {name.strip() for name in os.environ.get(REQUIRED, "").split(",") if name.strip()}
    marks = {arg for mark in item.iter_markers("must_run") for arg in mark.args}
    if report.skipped and marks & required:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} skipped, but {REQUIRED}={os.environ[REQUIRED]} requires it "
            f"({', '.join(sorted(marks & required))}): {reason}"
        )


@pytest.fixture(autouse=True)
def _restore_environ():
    """Tests may set launcher variables; none may leak into the next test."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


LAUNCH_MARK = "DDPKIT_TEST_LAUNCH"  # inherited by the launcher's workers: finds them in any session


def marked(mark: str, var: str = LAUNCH_MARK) -> list[int]:
    """Pids of the live processes whose environment holds `var=mark` (they inherited it from a launch)."""
    pids, needle = [], f"{var}={mark}".encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if needle in (proc / "environ").read_bytes().split(b"\0") and (proc / "stat").read_text().split(
                ") ", 1)[1][0] != "Z":  # fmt: skip
                pids.append(int(proc.name))
        except OSError:  # gone, or not ours
            continue
    return pids


def end_launch(proc: subprocess.Popen, mark: str) -> None:
    """SIGKILL the launcher's process group and every process that inherited its mark: torchrun starts
    each worker in a session of its own, so killing the launcher's group alone leaves them running."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for _ in range(50):  # a worker may be forking a child of its own while we kill
        pids = marked(mark)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def popen_marked(
    cmd: list[str], *, cwd: Path | None = None, env: dict | None = None, **kwargs
) -> tuple[subprocess.Popen, str]:
    """Start `cmd` (a launcher: ddpkit run, torchrun) in a session of its own, its environment marked
    so that `end_launch` finds its workers; stdout and stderr piped unless given."""
    mark = uuid.uuid4().hex
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {}), LAUNCH_MARK: mark}
    kwargs.setdefault("stdout", subprocess.PIPE)
    kwargs.setdefault("stderr", subprocess.PIPE)
    proc = subprocess.Popen(cmd, text=True, cwd=cwd, env=full_env, start_new_session=True, **kwargs)
    return proc, mark


def popen_cli(
    *args: str, cwd: Path | None = None, env: dict | None = None, **kwargs
) -> tuple[subprocess.Popen, str]:
    """`ddpkit ...` started by `popen_marked`."""
    return popen_marked([sys.executable, "-m", "ddpkit.cli", *args], cwd=cwd, env=env, **kwargs)


def communicate(proc: subprocess.Popen, mark: str, timeout: float) -> subprocess.CompletedProcess:
    """Wait for a `popen_cli` launch; on a timeout end it and its workers, then raise TimeoutExpired.
    Workers left behind by a launcher that exited (killed, or crashed) are ended too."""
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        end_launch(proc, mark)
        try:
            stdout, stderr = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # a process that escaped still holds the pipes open
            stdout = stderr = None
        raise subprocess.TimeoutExpired(proc.args, timeout, stdout, stderr) from None
    if marked(mark):
        end_launch(proc, mark)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def run_marked(cmd: list[str], *, timeout: float, cwd: Path | None = None, env: dict | None = None):
    """subprocess.run for a launcher: on a timeout it and all its workers are killed before
    subprocess.TimeoutExpired is raised (subprocess.run would kill only the launcher)."""
    proc, mark = popen_marked(cmd, cwd=cwd, env=env)
    return communicate(proc, mark, timeout)


def run_cli(*args: str, timeout: float = 120, cwd: Path | None = None, env: dict | None = None):
    """Run `ddpkit ...` as a user would, in a subprocess; return the CompletedProcess. On a timeout the
    launcher and all its workers are killed before subprocess.TimeoutExpired is raised."""
    return run_marked([sys.executable, "-m", "ddpkit.cli", *args], timeout=timeout, cwd=cwd, env=env)


def fresh_python(code: str, timeout: float = 60) -> str:
    """Run `code` in a new interpreter (nothing imported yet, ddpkit from this checkout); its stdout."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout
