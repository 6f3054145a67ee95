"""`ddpkit verify --resume-script` on planted copies of a GPT-style loop (tests/idioms_port.py): the
prefetched batch and the evaluation's draws are caught and named, the batch saved per rank passes, both
when the script is killed (kill -9, then restarted) and when it is preempted (`--stop signal`: ddpkit saves
at the next step boundary and exits 75). The README's own checkpoint loop passes, as written. Each check is
three real `ddpkit run` launches of 2 ranks; the verdicts on records that need no launch (a script that
never loads, a preempted state without step=) are judged from records written here."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, run_cli

from ddpkit.verify.script_resume import ScriptRun, check_script, compare

sys.path.insert(0, str(REPO / "scripts"))
import docs_examples

PORT = str(REPO / "tests" / "idioms_port.py")


def _check(tmp_path: Path, shape: str, how: str = "kill", stop_at: int = 3):
    run = ScriptRun(
        script=PORT,
        args=["--shape", shape],
        nproc=2,
        stop_at=stop_at,
        how=how,
        workdir=str(tmp_path),
        timeout=240,
    )
    return check_script(run)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("how", ["kill", "signal"])
def test_a_loop_that_saves_its_prefetched_batch_passes(tmp_path: Path, how: str) -> None:
    report = _check(tmp_path, "per-rank", how, stop_at=2)  # signal: the preemption's save holds X, Y
    assert report.passed, report.render()
    assert f"stopped ({how}) at step 2: PASSED, the last checkpoint is bitwise the uninterrupted run's" in (
        report.render()
    )


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("how", "at"), [("kill", 3), ("signal", 2)])  # either way resumed before step 3
def test_a_prefetched_batch_is_named_at_the_first_step_after_the_resume(
    tmp_path: Path, how: str, at: int
) -> None:
    report = _check(tmp_path, "prefetch", how, stop_at=at)
    text = report.render()
    assert not report.passed, text
    assert "the last checkpoint differs from the uninterrupted run's: rank 0: the weights of model" in text, (
        text
    )
    for rank in (0, 1):
        assert f"rank {rank}: step 3 (the first after the checkpoint resumed from) starts with the same " in (
            text
        ), text
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


@pytest.mark.timeout(900)
def test_under_preemption_the_evaluations_draws_are_named(tmp_path: Path) -> None:
    """Preempted after step 2, the save at the loop's top writes after the evaluation drew; the resumed
    run evaluates again at that top, before step 3."""
    report = _check(tmp_path, "eval", "signal", stop_at=2)
    text = report.render()
    assert not report.passed, text
    assert "stopped (signal) at step 2: FAILED" in text, text
    for rank in (0, 1):
        assert (
            f"rank {rank}: step 3 (the first after the checkpoint resumed from) starts with other generator "
            "states although s.load restored them" in text
        ), text


def _readme_checkpoint_loop() -> str:
    """The README's checkpoint loop (the block under "Checkpoints") after the docs' prelude, as a script."""
    [block] = [b for b in docs_examples.blocks() if b.where.startswith("README.md") and "s.save(" in b.code]
    return docs_examples.PRELUDE + "\n" + block.code


@pytest.mark.timeout(900)
def test_the_readmes_checkpoint_loop_resumes_exactly_as_written(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(_readme_checkpoint_loop())
    report = check_script(
        ScriptRun(script=str(script), nproc=2, stop_at=2, workdir=str(tmp_path), timeout=240)
    )
    assert report.passed, report.render()
    assert "train.py: 2 rank(s), stopped (kill) at step 2: PASSED" in report.render()


# -- verdicts from records (what each rank's session writes under verify; no launch needed) ------------
def _save(step: Any, weights: str) -> dict[str, Any]:
    digests = {"rank": "r", "rng": "g", "values": {}, "weights": {"model": weights}, "objects": {}}
    return {"event": "save", "step": step, "digests": digests}


def _step(weights: str) -> dict[str, Any]:
    return {"event": "step", "rng": "g", "weights": {"model": weights}}


def test_a_script_that_never_loads_did_not_resume_even_when_its_checkpoints_agree() -> None:
    full = [[_step("a"), _save(1, "a"), _step("b"), _save(2, "b")]] * 2
    first = [[_step("a"), _save(1, "a"), _step("b")]] * 2
    again = [[_step("a"), _save(1, "a"), _step("b"), _save(2, "b")]] * 2  # from the start: the same bytes
    report = compare(full, first, again, ScriptRun(script="train.py", stop_at=2))
    assert not report.passed, report.render()
    assert "FAILED, it did not resume: the script never calls s.load, so after the stop it trains again" in (
        report.render()
    )
    found_nothing = [[{"event": "load", "checkpoint": None}, *again[0]]] * 2
    report = compare(full, first, found_nothing, ScriptRun(script="train.py", stop_at=2))
    assert not report.passed and "s.load found no checkpoint in its root" in report.render(), report.render()
    too_early = [[{"event": "load", "checkpoint": None}, _step("a"), _step("b")]] * 2  # stopped before a save
    report = compare(full, too_early, found_nothing, ScriptRun(script="train.py", stop_at=2))
    assert not report.passed and "had written no checkpoint yet. Pass a later --save-at" in report.render()


def test_a_preempted_state_without_step_is_named() -> None:
    full = [[_save(None, "0"), _step("a"), _step("b"), _step("c"), _save(None, "c")]] * 2
    first = [[_save(None, "0"), _step("a"), _step("b"), _save(None, "b")]] * 2  # the preemption's save
    second = [[{"event": "load", "checkpoint": "ckpt-2"}, _step("c"), _step("d"), _save(None, "d")]] * 2
    report = compare(full, first, second, ScriptRun(script="train.py", stop_at=2, how="signal"))
    assert not report.passed
    assert "the state given to s.save has no step=: ddpkit advances only step=" in report.render(), (
        report.render()
    )
    killed = compare(full, first, second, ScriptRun(script="train.py", stop_at=2, how="kill"))
    assert "has no step=" not in killed.render()  # kill -9 writes nothing of its own
