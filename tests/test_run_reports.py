"""What `ddpkit run` tells a user when a job ends badly: one paragraph for a mistake the user can fix,
and the rank that died first named at every restart. Real torchrun agents, real gloo ranks, real files.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import refusal_train
from conftest import run_cli

from ddpkit.checkpoint import files

HERE = Path(__file__).parent
SCRIPT = str(HERE / "refusal_train.py")


class _Planted:
    """A pickle that would create a file if anything unpickled it."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _plant(checkpoint: Path, marker: Path) -> None:
    """Replace the DCP metadata by a pickle, and forge the manifest's checksums to match it."""
    (checkpoint / "dcp" / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    for name in manifest["files"]:
        p = checkpoint / name
        manifest["files"][name] = {"bytes": p.stat().st_size, "sha256": files.sha256_of(p)}
    files.write_manifest(
        checkpoint, {k: v for k, v in manifest.items() if k not in ("format", "self_sha256")}
    )
    files.verify(checkpoint)  # forged well: the manifest alone cannot tell


def two_steps_saved(ckpt: str) -> None:
    """On the pool's ranks: what `ddpkit run --nproc 2 refusal_train.py CKPT` writes (two FSDP steps, each
    saved: sharded checkpoints, DCP's metadata a pickle), without a launch of its own."""
    import contextlib
    import io
    import sys

    argv = sys.argv
    sys.argv = ["refusal_train.py", ckpt]
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # its start-up lines: not into the suite's output
            refusal_train.main()
    finally:
        sys.argv = argv


@pytest.mark.timeout(150)
def test_a_planted_sharded_checkpoint_ends_the_job_with_one_paragraph(pool2, tmp_path: Path) -> None:
    ckpt, marker = tmp_path / "ck", tmp_path / "pwned"
    pool2.run(two_steps_saved, str(ckpt), timeout=60)
    _plant(ckpt / "ckpt-000002", marker)
    done = run_cli("run", "--nproc", "2", SCRIPT, str(ckpt), timeout=60)
    assert done.returncode == 1, done.stderr
    assert not marker.exists(), "the planted pickle ran"
    out = done.stdout + done.stderr
    assert out.count("refused to load") == 1, out  # once for the job, not once per rank
    assert f"refused to load {ckpt}/ckpt-000002" in done.stderr and "names posix.system" in done.stderr
    assert "Move ckpt-000002 out of" in done.stderr and "raised by 2 ranks alike" in done.stderr
    assert "Traceback" not in out, out


@pytest.mark.timeout(150)
def test_each_restart_names_the_rank_that_died_first(tmp_path: Path) -> None:
    # one job, two restarts: rank 1 killed on the first attempt, raising on the second, done on the third
    ckpt = str(tmp_path / "ck")
    done = run_cli(
        "run",
        "--nproc",
        "2",
        "--max-restarts",
        "2",
        SCRIPT,
        ckpt,
        "--strategy",
        "ddp",
        "--die-at",
        "1:1:KILL,1:1:RAISE",
        timeout=120,
    )
    assert done.returncode == 0, done.stderr  # the restarted workers finished
    lines = [line for line in done.stderr.splitlines() if line.startswith("ddpkit run: restart")]
    assert len(lines) == 2, done.stderr
    for n, (line, said) in enumerate(zip(lines, SAID, strict=True), 1):
        assert line.startswith(f"ddpkit run: restart {n} of 2: rank 1 (local rank 1 on host "), line
        assert said in line, line
    assert "done at step 2" in done.stdout + done.stderr


SAID = ("died first, killed by SIGKILL", "failed first with RuntimeError: planted failure on rank 1")


def test_a_restart_on_the_second_node_names_the_rank_by_its_global_rank(tmp_path: Path) -> None:
    """On node 1 of 2 (one rank a node), torchrun's agent hands its monitor the failures keyed by GLOBAL rank,
    each a ProcessFailure carrying the LOCAL rank: the restart line must say rank 1 (the rank the user's
    logs and tracebacks use), with local rank 0 beside it, not the local rank twice."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from ddpkit.cluster.run_report import restart_line

    killed = ProcessFailure(local_rank=0, pid=4242, exitcode=-9, error_file=str(tmp_path / "none.json"))
    line = restart_line({1: killed}, restart=1, budget=1, host="node1")
    assert line.startswith("ddpkit run: restart 1 of 1: rank 1 (local rank 0 on host node1, pid 4242)"), line
    assert "died first, killed by SIGKILL" in line, line


def _failure(tmp_path: Path, rank: int, exitcode: int, exc: BaseException | None, when: float):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from ddpkit.cluster.failures import write_error_file

    path = tmp_path / f"error-{rank}.json"
    if exc is not None:
        write_error_file(str(path), exc, rank, when)
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(path))


def test_a_rank_killed_from_outside_is_named_before_the_peer_it_broke(tmp_path: Path) -> None:
    """The peer's error file can be older than the second in which the agent noticed the killed rank
    (torchrun then names the peer); a signal nobody in the job sent is the cause."""
    import time

    from ddpkit.cluster.run_report import first_failure

    peer = _failure(tmp_path, 0, 1, ConnectionError("Connection closed by peer"), time.time() - 5)
    killed = _failure(tmp_path, 1, -9, None, 0)
    stopped = _failure(tmp_path, 2, -15, None, 0)  # the agent's SIGTERM to the survivors
    assert first_failure({0: peer, 1: killed, 2: stopped})[0] == 1
    assert first_failure({0: peer, 2: stopped})[0] == 0  # no outside kill: the earliest error
    raised = _failure(tmp_path, 3, 1, RuntimeError("the cause"), time.time() + 0.5)
    assert first_failure({2: stopped, 3: raised})[0] == 3  # the stop is noticed in whole seconds: a victim
