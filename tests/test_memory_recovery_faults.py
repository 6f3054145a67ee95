"""Recoveries from memory snapshots under `ddpkit run` (`ddpkit.checkpoint.memory`, `ddpkit.cluster.keeper`).

A 4-rank FSDP run loses one rank to kill -9 at a random step (the seed printed), or in the middle of
copying a snapshot; torchrun's agent restarts the group; the restarted ranks restore the newest step
every rank holds from the keeper's memory, redo at most one step, and end bitwise like the
uninterrupted run of the same code in the 4-rank pool (same world size, one thread per rank). The
restored step is what shows memory was used: a restart from scratch ends bitwise equal too.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from conftest import REPO, run_cli
from memory_recovery_train import train
from resume_train import same

from ddpkit.cluster.keeper import Keeper

TRAIN = str(REPO / "tests" / "memory_recovery_train.py")
_references: dict[str, list[dict]] = {}


def _fsdp_reference(pool4, strategy: str = "fsdp") -> list[dict]:
    """The uninterrupted 4-rank run in the pool, once per strategy and test session."""
    if strategy not in _references:
        _references[strategy] = pool4.run(train, None, None, strategy, timeout=120)
    return _references[strategy]


def _recover(pool4, out: Path, *fault: str) -> int:
    """Run with `fault` under `ddpkit run --max-restarts 1`; check the end against the reference;
    return the step restored from memory."""
    out.mkdir()
    keeper = Keeper.start()
    try:
        done = run_cli(
            "run",
            "--nproc",
            "4",
            "--max-restarts",
            "1",
            TRAIN,
            str(out),
            "--keeper",
            keeper.name,
            *fault,
            timeout=240,
        )
    finally:
        keeper.stop()
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "killed.txt").exists(), "the fault did not happen"
    for rank, want in enumerate(_fsdp_reference(pool4)):
        got = torch.load(out / f"rank{rank}.pt", weights_only=True)
        assert same(got, want) == [], f"rank {rank} differs from the uninterrupted run at {same(got, want)}"
    return int((out / "resumed.txt").read_text().split()[1])


@pytest.mark.timeout(300)
def test_a_killed_fsdp_rank_recovers_from_memory_with_one_step_redone_bitwise(pool4, tmp_path: Path) -> None:
    seed = random.randrange(1 << 30)
    draw = random.Random(seed)
    kill_at, rank = draw.randint(2, 12), draw.randrange(4)
    print(f"\nseed {seed}: kill -9 of rank {rank} in step {kill_at}")
    restored = _recover(pool4, tmp_path / "out", "--kill-at", str(kill_at), "--kill-rank", str(rank))
    assert restored == kill_at - 1, f"restored step {restored}: {kill_at - restored} steps redone, not 1"


@pytest.mark.timeout(300)
def test_a_kill_in_the_middle_of_a_snapshot_restores_the_step_before_on_every_rank(
    pool4, tmp_path: Path
) -> None:
    restored = _recover(pool4, tmp_path / "out", "--kill-mid-snapshot", "7", "--kill-rank", "3")
    assert "mid-snapshot" in (tmp_path / "out" / "killed.txt").read_text()
    assert restored == 6, f"restored step {restored}: rank 3's torn snapshot 7 was taken, or an older one"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["fsdp", "hsdp-2x2"])
def test_s_load_with_memory_under_ddpkit_run_recovers_a_killed_rank_from_the_keeper(
    pool4, tmp_path: Path, strategy: str
) -> None:
    # The product's way: `ddpkit run` starts the keeper, `s.load(root, ..., memory=1)` restores from it
    # and snapshots at the loader's next batch (after the scheduler's step: it must not be one behind).
    out = tmp_path / "out"
    out.mkdir()
    args = [TRAIN, str(out), "--strategy", strategy, "--memory", "1", "--kill-at", "8"]
    done = run_cli("run", "--nproc", "4", "--max-restarts", "1", *args, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ddpkit: resumed from memory at step 7" in done.stdout, done.stdout[-3000:]
    for rank, want in enumerate(_fsdp_reference(pool4, strategy)):
        got = torch.load(out / f"rank{rank}.pt", weights_only=True)
        assert same(got, want) == [], f"rank {rank} differs from the uninterrupted run at {same(got, want)}"


@pytest.mark.timeout(300)
def test_under_ddpkit_fit_a_killed_rank_recovers_from_memory_bitwise(pool2, tmp_path: Path) -> None:
    # ddpkit.fit's own loop (the scheduler stepped after each optimizer step, before the next batch) under
    # DDP at 2 ranks: the snapshot at the loader's next batch holds the scheduler after the same step.
    out = tmp_path / "out"
    out.mkdir()
    args = [
        TRAIN,
        str(out),
        "--strategy",
        "ddp",
        "--memory",
        "1",
        "--fit",
        "--kill-at",
        "9",
        "--kill-rank",
        "0",
    ]
    done = run_cli("run", "--nproc", "2", "--max-restarts", "1", *args, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ddpkit: resumed from memory at step 8" in done.stdout, done.stdout[-3000:]
    reference = pool2.run(train, None, None, "ddp", None, 1, None, None, 0, (), 0.0, 0, True, timeout=120)
    for rank, want in enumerate(reference):
        got = torch.load(out / f"rank{rank}.pt", weights_only=True)
        assert same(got, want) == [], f"rank {rank} differs from the uninterrupted fit at {same(got, want)}"
