"""The warm start: processes forked from a server that imported torch once behave as new interpreters
would (arguments, environment, working directory, stdio, exit codes, signals, tracebacks), end with
their client, and start fresh when a variable read at load time differs; `ddpkit run` forks its ranks
from it; `ddpkit.spawn(start_method="forkserver")` forks its ranks from Python's forkserver."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import _warm, marked, popen_marked, python, run_cli

import ddpkit
from ddpkit.cluster.warmstart import client as warm_client
from ddpkit.cluster.warmstart import load_time_env
from ddpkit.names import WARM_START_ENV

# Printed by a script at its first line: whether torch was loaded before it imported anything (warm). One
# write per line: two ranks share a pipe, and under PYTHONUNBUFFERED `print` writes each argument apart.
PROBE = textwrap.dedent("""
    import os, sys
    os.write(1, f"warm {'torch' in sys.modules} argv {sys.argv[1:]} cwd {os.getcwd()} x {os.environ.get('X')} "
                f"main {__name__}\\n".encode())
""")


def _suite_server() -> Path | None:
    """The suite's server (tests/conftest.py), when it runs and started with this process's load-time
    variables (a test that changed one of them before the session's first launch would have given it
    others: then its forks could not be warm for this module's requests)."""
    client = Path(python())
    pid = getattr(_warm.get("server"), "pid", None)
    if client == Path(sys.executable) or pid is None:
        return None
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    env = dict(item.decode(errors="replace").split("=", 1) for item in environ if b"=" in item)
    return client.parent if load_time_env(env) == load_time_env(os.environ) else None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The suite's server, else (DDPKIT_TEST_WARM=0, or another load-time environment) one of this
    module's own, which costs a second import of torch and ddpkit."""
    suite = _suite_server()
    if suite is not None:
        yield suite
        return
    directory = tmp_path_factory.mktemp("warm")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpkit.cluster.warmstart", str(directory)], start_new_session=True
    )
    deadline = time.monotonic() + 60
    while warm_client(directory) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    yield directory
    proc.terminate()
    proc.wait(10)


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "script.py"
    path.write_text(PROBE + textwrap.dedent(body))
    return path


def run(server: Path, *args: str, env: dict | None = None, cwd: Path | None = None, timeout: float = 60):
    return subprocess.run(
        [str(warm_client(server)), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )


def test_a_forked_script_gets_its_arguments_environment_directory_and_exit_code(server, tmp_path) -> None:
    script = _script(tmp_path, "import torch; sys.exit(int(sys.argv[1]))")
    done = run(server, "-u", str(script), "3", "b c", env={"X": "from-the-client"}, cwd=tmp_path)
    assert done.returncode == 3, done.stderr
    assert done.stdout.split("\n")[0] == (
        f"warm True argv ['3', 'b c'] cwd {tmp_path} x from-the-client main __main__"
    )


def test_an_error_prints_the_users_traceback_and_exits_1(server, tmp_path) -> None:
    script = _script(tmp_path, "def f():\n    raise ValueError('boom')\nf()\n")
    done = run(server, str(script))
    assert done.returncode == 1
    assert done.stderr.startswith('Traceback (most recent call last):\n  File "' + str(script))
    assert done.stderr.rstrip().endswith("ValueError: boom") and "warmstart.py" not in done.stderr


def test_a_signal_to_the_client_reaches_the_script_and_its_exit_comes_back(server, tmp_path) -> None:
    script = _script(
        tmp_path,
        """
        import signal, time
        signal.signal(signal.SIGTERM, lambda s, f: sys.exit(7))
        print("ready", flush=True)
        time.sleep(60)
    """,
    )
    proc, _ = popen_marked([str(warm_client(server)), str(script)])
    assert proc.stdout.readline().startswith("warm True") and proc.stdout.readline() == "ready\n"
    os.killpg(proc.pid, signal.SIGTERM)  # as torchrun's agent stops a worker
    assert proc.wait(30) == 7


def test_a_killed_client_takes_its_forked_process_with_it(server, tmp_path) -> None:
    script = _script(tmp_path, "import time\nprint(os.getpid(), flush=True)\ntime.sleep(60)\n")
    proc, mark = popen_marked([str(warm_client(server)), str(script)])
    assert proc.stdout.readline().startswith("warm True")
    forked = int(proc.stdout.readline())
    assert forked != proc.pid
    os.kill(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and Path(f"/proc/{forked}").exists():
        time.sleep(0.05)
    assert not Path(f"/proc/{forked}").exists(), "the forked script outlived its client"
    assert proc.wait(10) == -signal.SIGKILL and not marked(mark)


def test_a_script_killed_by_a_signal_ends_its_client_by_the_same_signal(server, tmp_path) -> None:
    script = _script(tmp_path, "os.kill(os.getpid(), 9)")
    assert run(server, str(script)).returncode == -signal.SIGKILL


def test_another_load_time_variable_or_option_starts_a_new_interpreter(server, tmp_path) -> None:
    script = _script(tmp_path, "")
    # read by glibc as the process loads; another value than the server's (also when the suite itself runs
    # with one, or under ATEN_CPU_CAPABILITY=default, which the server then has too)
    arenas = str(int(os.environ.get("MALLOC_ARENA_MAX", "0")) + 2)
    fresh = run(server, str(script), env={"MALLOC_ARENA_MAX": arenas})
    assert fresh.returncode == 0 and fresh.stdout.startswith("warm False"), fresh.stderr
    assert run(server, "-c", "import sys; print('torch' in sys.modules)").stdout == "False\n"
    assert run(server, "-m", "json.tool", "--help").returncode == 0


def test_ddpkit_run_forks_its_ranks_from_the_server(server, tmp_path) -> None:
    script = _script(tmp_path, "")
    cold = run_cli("run", "--nproc", "2", str(script), env={WARM_START_ENV: ""}, cwd=tmp_path)
    warm = run_cli("run", "--nproc", "2", str(script), env={WARM_START_ENV: str(server)}, cwd=tmp_path)
    assert cold.returncode == warm.returncode == 0, (cold.stderr, warm.stderr)
    assert cold.stdout.count("warm False") == 2 and warm.stdout.count("warm True") == 2, warm.stdout


def _loaded(name: str) -> bool:
    return name in sys.modules


def test_spawn_forks_importable_functions_from_a_preloaded_server() -> None:
    # torch._dynamo: imported by the server for every rank; a new interpreter only imports it when used
    warm = {"start_method": "forkserver", "timeout": 60}
    assert ddpkit.spawn(_loaded, nproc=2, args=("torch._dynamo",), **warm) == [True, True]
    # read as torch loads, so another value than this process's means new interpreters (the suite may run
    # under ATEN_CPU_CAPABILITY=default itself)
    other = "avx2" if os.environ.get("ATEN_CPU_CAPABILITY") == "default" else "default"
    portable = {"ATEN_CPU_CAPABILITY": other}
    # one rank each: the start method is chosen per call, and a new interpreter costs ~3 s of CPU
    assert ddpkit.spawn(_loaded, nproc=1, args=("torch._dynamo",), env=portable, **warm) == [False]
    assert ddpkit.spawn(_loaded, nproc=1, args=("torch._dynamo",), timeout=60) == [False]  # "auto"


def test_the_client_script_appears_whole_and_executable(tmp_path, monkeypatch) -> None:
    # A launch that finds the client's path runs it at once: written in place and then made executable, it
    # was once found not yet executable (PermissionError). It must come into place by a rename of a file
    # already whole and executable.
    from ddpkit.cluster import warmstart

    seen = []
    real_replace = os.replace

    def replace(src, dst):
        src, dst = Path(src), Path(dst)
        seen.append((dst.name, dst.exists(), os.access(src, os.X_OK), src.read_text()))
        real_replace(src, dst)

    monkeypatch.setattr(warmstart.os, "replace", replace)
    warmstart._write_client(tmp_path)
    client = tmp_path / warmstart.CLIENT
    assert seen == [(warmstart.CLIENT, False, True, client.read_text())], seen
    assert client.read_text().startswith("#!/bin/sh\nexec ") and os.access(client, os.X_OK)
    assert sorted(p.name for p in tmp_path.iterdir()) == [warmstart.CLIENT]  # nothing staged left behind
