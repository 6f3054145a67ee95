"""A start-up meeting that runs out of `rendezvous_timeout` is one paragraph naming what timed out, the
store's address and the fix, not torch's DistStoreError / DistNetworkError: for the rank hosting the store
(the others never connected), for a rank that cannot reach it (its host never started), and under
`ddpkit run` for a rank that starts too late (named by its rank). The three launches run side by side."""

from __future__ import annotations

import socket
import sys

from conftest import communicate, popen_cli, popen_marked

SCRIPT = """
import os, time
import ddpkit
if os.environ.get("LATE_RANK") == os.environ["RANK"]:
    time.sleep(float(os.environ["LATE_S"]))
with ddpkit.session(rendezvous_timeout=float(os.environ["MEET_S"]), verbose=False) as s:
    print("met", s.rank)
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _alone(script: str, rank: int, port: int):
    env = {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "MEET_S": "2",
    }
    return popen_marked([sys.executable, script], env=env)


def test_a_meeting_that_times_out_names_who_never_came_and_where(tmp_path) -> None:
    script = tmp_path / "meet.py"
    script.write_text(SCRIPT)
    host_port, client_port = _free_port(), _free_port()
    launches = {
        "host": _alone(str(script), 0, host_port),  # rank 0 of 2, alone: hosts the store, nobody comes
        "client": _alone(str(script), 1, client_port),  # rank 1 of 2, alone: no store to reach
        "late": popen_cli(
            "run", "--nproc", "2", str(script), env={"LATE_RANK": "1", "LATE_S": "12", "MEET_S": "3"}
        ),
    }
    done = {name: communicate(proc, mark, timeout=90) for name, (proc, mark) in launches.items()}
    for name, result in done.items():
        assert result.returncode != 0 and "met" not in result.stdout, (name, result.stdout)
        raw = ("torch.distributed.DistStoreError:", "torch.distributed.DistNetworkError:")
        assert not [e for e in raw if e in result.stderr], result.stderr
    host = done["host"].stderr
    assert (
        "DdpkitError: the ranks did not meet within rendezvous_timeout=2 s: rank 0 hosts the rendezvous"
        in host
    )
    assert f"store at 127.0.0.1:{host_port} and only 1 of the 2 ranks reached it; 1 never arrived" in host
    client = done["client"].stderr
    assert (
        f"rank 1 could not reach the rendezvous store at 127.0.0.1:{client_port}, which rank 0 hosts"
        in client
    )
    late = done["late"].stderr
    assert "ddpkit run: the ranks did not meet within rendezvous_timeout=3 s: rank 0 reached" in late, late
    assert "but rank(s) 1 of the 2 never joined the process group" in late, late
    for text in (host, client, late):
        assert "ddpkit.session(rendezvous_timeout=SECONDS)" in text and "reachable from every host" in text


def test_a_taken_store_port_and_an_unknown_failure_are_said_as_such() -> None:
    from ddpkit.cluster import rendezvous_report

    taken = RuntimeError(
        "The server socket has failed to listen on any local network address. port: 29500, useIpv6: false, "
        "code: -98, name: EADDRINUSE, message: address already in use"
    )
    said = str(rendezvous_report.explain(taken, rank=0, world_size=2, address="10.0.0.1:29500", timeout=600))
    assert said.startswith("rank 0 cannot host the rendezvous store at 10.0.0.1:29500: the port is taken"), (
        said
    )
    assert "ddpkit run --port P" in said and "did not meet" not in said
    other = rendezvous_report.explain(RuntimeError("boom"), rank=1, world_size=4, address="h:1", timeout=5)
    assert str(other).startswith("the ranks could not meet at h:1 (rendezvous_timeout=5 s): boom."), str(
        other
    )
