"""`ddpkit verify --resume-script` on planted copies of a GPT-style loop (tests/idioms_port.py): the
prefetched batch and the evaluation's draws are caught and named, the batch saved per rank and the
sound loop pass. Each check is three real `ddpkit run` launches of 2 ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import REPO, run_cli

from ddpkit.verify.script_resume import ScriptRun, check_script

PORT = str(REPO / "tests" / "idioms_port.py")


def _check(tmp_path: Path, shape: str):
    run = ScriptRun(
        script=PORT, args=["--shape", shape], nproc=2, stop_at=3, workdir=str(tmp_path), timeout=240
    )
    return check_script(run)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("shape", ["good", "per-rank"])
def test_a_loop_that_saves_everything_passes(tmp_path: Path, shape: str) -> None:
    report = _check(tmp_path, shape)
    assert report.passed, report.render()
    assert "PASSED, the last checkpoint is bitwise the uninterrupted run's" in report.render()


@pytest.mark.timeout(900)
def test_a_prefetched_batch_is_named_at_the_first_step_after_the_resume(tmp_path: Path) -> None:
    report = _check(tmp_path, "prefetch")
    text = report.render()
    assert not report.passed, text
    assert "the last checkpoint differs from the uninterrupted run's: rank 0: the weights of model" in text, (
        text
    )
    for rank in (0, 1):
        assert (
            f"rank {rank}: step 3 (the first after the checkpoint resumed from) starts with the same " in text
        )
    assert "its inputs differ, a batch drawn before the save point (a prefetched batch)" in text, text


@pytest.mark.timeout(900)
def test_draws_of_an_evaluation_after_the_save_point_are_named(tmp_path: Path) -> None:
    done = run_cli(
        "verify",
        "--resume-script",
        PORT,
        "--save-at",
        "3",
        "--workdir",
        str(tmp_path),
        "--",
        "--shape",
        "eval",
        timeout=800,
    )
    text = done.stdout
    assert done.returncode == 1, done.stdout + done.stderr[-3000:]
    assert "idioms_port.py: 2 rank(s), stopped (kill) at step 3: FAILED" in text, text
    assert (
        "rank 0: step 3 (the first after the checkpoint resumed from) starts with other generator states"
        in text
    )
    assert "an evaluation at the resumed step" in text, text
