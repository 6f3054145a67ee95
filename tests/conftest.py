"""Shared fixtures: long-lived rank pools, environment hygiene, helpers to run the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
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


def run_cli(*args: str, timeout: float = 120, cwd: Path | None = None, env: dict | None = None):
    """Run `ddpkit ...` as a user would, in a subprocess; return the CompletedProcess."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "ddpkit.cli", *args],
        capture_output=True, text=True, timeout=timeout, cwd=cwd, env=full_env,
    )  # fmt: skip


def fresh_python(code: str, timeout: float = 60) -> str:
    """Run `code` in a new interpreter (nothing imported yet, ddpkit from this checkout); its stdout."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout
