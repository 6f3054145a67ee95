"""`ddpkit doctor`: the facts, the verdict in the exit code, and a real 2-process smoke test."""

from __future__ import annotations

import json
import subprocess
import sys

from ddpkit.tools import doctor


def _doctor(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(
        [sys.executable, "-m", "ddpkit.tools.doctor", *args],
        capture_output=True,
        text=True,
        timeout=90,
        env={**os.environ, **(env or {})},
    )


def test_healthy_machine_exits_0_after_a_real_all_reduce() -> None:
    out = _doctor()
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert "torch" in text and "mode auto:" in text and "free TCP port" in text
    assert "smoke test (gloo, CPU): 2 ranks, backend gloo, all_reduce = 3 (want 3)" in text
    assert text.strip().endswith("healthy")


def test_json_report_and_unhealthy_plan_exit_1() -> None:
    bad = {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "5", "LOCAL_WORLD_SIZE": "2"}
    out = _doctor("--json", "--no-smoke", env=bad)
    assert out.returncode == 1, out.stdout + out.stderr
    facts = json.loads(out.stdout)
    assert facts["healthy"] is False and "local rank 5" in facts["plan_error"]
    assert facts["env"]["LOCAL_RANK"] == "5" and facts["backends"]["gloo"] is True


def test_launcher_env_keeps_only_launch_and_comm_variables() -> None:
    env = {"RANK": "1", "SLURM_PROCID": "1", "NCCL_DEBUG": "INFO", "HOME": "/root", "PATH": "/bin"}
    assert doctor.launcher_env(env) == {"NCCL_DEBUG": "INFO", "RANK": "1", "SLURM_PROCID": "1"}


def test_free_port_is_bindable() -> None:
    import socket

    port = doctor.free_port()
    assert 1024 <= port <= 65535  # an unprivileged port, picked by the kernel
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))  # raises if the port were taken
        assert sock.getsockname() == ("127.0.0.1", port)
