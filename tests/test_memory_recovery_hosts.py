"""A lost host recovered from its buddy's memory, through `ddpkit run` itself: two hosts (network
namespaces, tests/test_elastic.py's `_Hosts`), one FSDP rank each, `s.load(..., memory=1)` (the lost
host's test with `buddy="before-next-step"`). Each host's `ddpkit run` starts its keeper with a TCP port and a job token; the ranks meet through the job's store
and wire each keeper to the other host's (`ddpkit.checkpoint.memory_hosts`), which copies every
committed snapshot. Host 1 is SIGKILLed whole at a random step: its agent, its rank and its keeper (its
memory gone). A replacement host 1 starts with an empty keeper; its rank fetches its shards, optimizer
state, RNG and loader position from host 0's keeper over TCP; the run redoes at most the step in flight
and ends bitwise like the uninterrupted run at world size 2 (the 2-rank pool, same code). And an elastic
shrink (`--nnodes 1:2`, DDP): host 1 lost and not replaced, host 0 goes on from its own keeper's memory.
"""

from __future__ import annotations

import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO
from memory_recovery_train import train
from resume_train import same
from test_elastic import _Hosts, pytestmark  # noqa: F401 (root and iproute2, or skipped)

TRAIN = str(REPO / "tests" / "memory_recovery_train.py")


@pytest.fixture(scope="module")
def namespaces(tmp_path_factory):
    made = _Hosts(tmp_path_factory.getbasetemp())
    yield made
    made.close()


def _steps(out: Path, name: str = "steps.txt") -> list[tuple[float, int]]:
    """Rank 0's log: the steps finished (steps.txt), or those whose forward ran (forward.txt)."""
    path = out / name
    lines = path.read_text().splitlines() if path.exists() else []
    return [(float(t), int(step)) for t, step, *_ in (line.split() for line in lines)]


def _host(
    net: _Hosts, port: int, out: Path, i: int, log: str, nodes: str, strategy: str, buddy: str = "behind"
) -> subprocess.Popen:
    """Host i's `ddpkit run` (one rank, `s.load(..., memory=1, buddy=...)`), its output in OUT/log."""
    run = ["run", "--nnodes", nodes, "--nproc", "1", "--max-restarts", "3"]
    run += ["--rdzv-endpoint", f"10.77.0.1:{port}", "--local-addr", f"10.77.0.{i + 1}"]
    run += ["--rdzv-conf", "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=5"]
    script = [
        TRAIN,
        str(out),
        "--strategy",
        strategy,
        "--memory",
        "1",
        "--step-sleep",
        "0.3",
        "--buddy",
        buddy,
    ]
    cmd = [*net.enter(i), sys.executable, "-m", "ddpkit.cli", *run, *script]
    with open(out / log, "w") as file:
        return subprocess.Popen(
            cmd, env=net.env(i), stdout=file, stderr=subprocess.STDOUT, start_new_session=True
        )


def _lose_host_1_after(
    net: _Hosts, out: Path, first: subprocess.Popen, seed: int, log: str = "steps.txt"
) -> int:
    """SIGKILL host 1 whole once rank 0 has logged (in `log`) a random step from 3 to 9; the newest step
    logged before the loss."""
    lose_after = random.Random(seed).randint(3, 9)
    print(f"\nseed {seed}: host 1 lost after step {lose_after} ({log})")
    deadline = time.monotonic() + 90
    while not any(step >= lose_after for _, step in _steps(out, log)):
        logs = "".join(p.read_text()[-2000:] for p in out.glob("host*.log"))
        assert time.monotonic() < deadline and first.poll() is None, f"no progress\n{logs}"
        time.sleep(0.02)
    newest = max(step for _, step in _steps(out, log))
    net.lose(1)  # the agent, the rank and the keeper of host 1: its memory is gone
    return newest


@pytest.mark.timeout(240)
def test_a_lost_host_recovers_from_its_buddys_memory_with_one_step_redone_bitwise(
    namespaces: _Hosts, pool2, tmp_path: Path
) -> None:
    # buddy="before-next-step": each rank's snapshot of step k is acknowledged by the other host's keeper
    # before its forward of step k+1, and under FSDP rank 0's forward of k+1 (logged) waits for rank 1's
    # (the all-gather): host 1 lost during step k+1 leaves step k on host 0, whenever the loss lands.
    net, port = namespaces, next(namespaces.ports)
    out = tmp_path / "out"
    out.mkdir()
    procs: list[subprocess.Popen] = []

    def start(i: int, log: str) -> subprocess.Popen:
        procs.append(_host(net, port, out, i, log, "2", "fsdp", "before-next-step"))
        return procs[-1]

    try:
        first = start(0, "host0.log")
        start(1, "host1.log")
        in_flight = _lose_host_1_after(net, out, first, random.randrange(1 << 30), "forward.txt")
        time.sleep(0.5)
        start(1, "host1-replacement.log")
        assert first.wait(timeout=150) == 0, (out / "host0.log").read_text()[-3000:]
        assert procs[-1].wait(timeout=30) == 0, (out / "host1-replacement.log").read_text()[-3000:]
    finally:
        net.lose(0)
        net.lose(1)
        for proc in procs:
            proc.kill()
            proc.wait(timeout=20)
    logs = "".join(p.read_text() for p in sorted(out.glob("host*.log")))
    assert "ddpkit: resumed from memory at step" in logs, logs[-3000:]
    assert "the buddy copy (buddy='before-next-step') took" in logs, logs[-3000:]  # its cost, said
    restored = int((out / "resumed.txt").read_text().split()[1])
    assert restored >= in_flight - 1, (
        f"restored step {restored}; step {in_flight} was in flight at the loss: more than it redone"
    )
    reference = pool2.run(train, None, None, "fsdp", timeout=120)
    for rank in range(2):
        got = torch.load(out / f"rank{rank}.pt", weights_only=True)
        assert same(got, reference[rank]) == [], f"rank {rank} differs: {same(got, reference[rank])}"


@pytest.mark.timeout(240)
def test_an_elastic_shrink_of_a_ddp_run_recovers_from_memory_on_the_surviving_host(
    namespaces: _Hosts, tmp_path: Path
) -> None:
    # `--nnodes 1:2`, DDP: host 1 lost whole and not replaced; host 0 goes on alone at world size 1, its
    # rank taking its old rank's snapshot from its own keeper (`memory.MemorySnapshots._take_resized`):
    # the steps since the last snapshot redone at most, not the run from its start (no disk checkpoint).
    net, port = namespaces, next(namespaces.ports)
    out = tmp_path / "out"
    out.mkdir()
    procs = [_host(net, port, out, i, f"host{i}.log", "1:2", "ddp") for i in range(2)]
    try:
        done_before = _lose_host_1_after(net, out, procs[0], random.randrange(1 << 30))
        assert procs[0].wait(timeout=150) == 0, (out / "host0.log").read_text()[-3000:]
    finally:
        net.lose(0)
        net.lose(1)
        for proc in procs:
            proc.kill()
            proc.wait(timeout=20)
    log = (out / "host0.log").read_text()
    assert "; world size 2 -> 1: the RNG streams of ranks 1..1 are dropped" in log, log[-3000:]
    restored = int((out / "resumed.txt").read_text().split()[1])
    assert restored >= done_before, (
        f"restored step {restored}; step {done_before} had finished before the loss"
    )
    assert torch.load(out / "rank0.pt", weights_only=True)["step"] == 12
