"""`ddpkit verify --resume` across a change of shape: a run saved under HSDP(2x2) resumed under FSDP(2)
ends within the calibrated noise floor of the uninterrupted run, and a checkpoint of FSDP(2) resumed
under HSDP(2x2) loads the same weights but, when the optimizer was left out of it, the check names the
optimizer right after s.load. The runs go to the shared rank pools (every run builds its session,
model, optimizer and loader anew); the command line's own test, in fresh processes, is
tests/test_verify_resume.py's.
"""

from __future__ import annotations

import argparse

import pytest
from fsdp_train import data, net

from ddpkit import DdpkitError
from ddpkit.verify import VerifySpec
from ddpkit.verify.resume import Resumable, ResumeSpec, check

pytestmark = [pytest.mark.numerics, pytest.mark.timeout(240)]


def forgets_optimizer(s, model, optimizer, loader) -> Resumable:
    """Model, loader and s.stepper saved; the AdamW moments not (kept, so the check can name them)."""
    return Resumable(
        saved={"model": model, "loader": loader, "stepper": s.stepper}, others={"optimizer": optimizer}
    )


def _spec(strategy: str, **kwargs) -> VerifySpec:
    return VerifySpec(
        model=net, data=data, optimizer="adamw", steps=4, batch_size=16, nproc=4, strategy=strategy, **kwargs
    )


@pytest.fixture
def runner(pool2, pool4):
    pools = {2: pool2, 4: pool4}
    return lambda fn, world, args: pools[world].run(fn, *args)


def test_an_hsdp_2x2_run_resumed_under_fsdp_2_ends_within_the_floor(runner) -> None:
    rs = ResumeSpec(spec=_spec("hsdp", shard=2), world=4, resume_world=2, resume_strategy="fsdp")
    report = check(rs, runner=runner)
    text = report.render()
    assert report.passed and not report.bitwise, text
    assert report.shapes == ("HSDP(2x2)", "FSDP(2)"), report.shapes
    assert report.ran == ("HSDP (fully_shard, replicate 2 x shard 2)", "FSDP2 (fully_shard)"), report.ran
    assert "on 4 rank(s) under HSDP(2x2)" in text and "on 2 rank(s) under FSDP(2)" in text, text


def test_an_fsdp_2_checkpoint_under_hsdp_2x2_without_the_optimizer_is_named(runner) -> None:
    """The weights load across the shapes (nothing differs before the optimizer); the AdamW moments,
    gathered from their shards on both sides, are what is missing right after s.load."""
    rs = ResumeSpec(
        spec=_spec("fsdp"), world=2, resume_world=4, resume_strategy="hsdp", setup=forgets_optimizer
    )
    report = check(rs, runner=runner)
    text = report.render()
    assert not report.passed, text
    assert report.shapes == ("FSDP(2)", "HSDP(2x2)"), report.shapes
    assert report.ran == ("FSDP2 (fully_shard)", "HSDP (fully_shard, replicate 2 x shard 2)"), report.ran
    assert report.difference and report.difference["step"] == rs.k, text
    assert report.difference["key"].startswith("optimizer.state."), text
    assert "the optimizer `optimizer`: not saved" in text and "right after s.load" in text, text


def _ns(**kwargs) -> argparse.Namespace:
    base = {
        "nproc": 4,
        "resume_nproc": None,
        "resume_strategy": None,
        "resume_shard_degree": None,
        "save_at": None,
        "setup": None,
        "timeout": 60.0,
    }
    return argparse.Namespace(**{**base, **kwargs})


@pytest.mark.parametrize(
    ("strategy", "shard", "ns", "shapes"),
    [
        ("hsdp", 2, {}, ("HSDP(2x2)", "HSDP(2x2)")),
        ("hsdp", 2, {"resume_nproc": 2}, ("HSDP(2x2)", "HSDP(1x2)")),
        ("hsdp", None, {"resume_nproc": 2, "resume_strategy": "ddp"}, ("HSDP(2x2)", "DDP(2)")),
        ("fsdp", None, {"resume_strategy": "hsdp", "resume_shard_degree": 4}, ("FSDP(4)", "HSDP(1x4)")),
        ("ddp", None, {"resume_nproc": 1}, ("DDP(4)", "one process")),
    ],
)
def test_the_command_line_names_the_shape_of_each_part(strategy, shard, ns, shapes) -> None:
    from ddpkit.verify.resume import resume_spec

    rs = resume_spec(_ns(**ns), _spec(strategy, shard=shard))
    assert tuple(part.describe() for part in rs.parts) == shapes


@pytest.mark.parametrize(
    ("ns", "message"),
    [
        (
            {"resume_nproc": 2, "resume_strategy": "hsdp", "resume_shard_degree": 4},
            r"HSDP over 2 ranks cannot",
        ),
        ({"resume_strategy": "fsdp", "resume_shard_degree": 2}, r"is HSDP's. Pass --resume-strategy hsdp"),
        ({"resume_nproc": 3, "resume_strategy": "hsdp"}, r"does not divide the global batch|HSDP over 3"),
    ],
)
def test_an_impossible_resumed_shape_is_refused_before_any_rank_starts(ns, message) -> None:
    from ddpkit.verify.resume import resume_spec

    with pytest.raises(DdpkitError, match=message):
        resume_spec(_ns(**ns), _spec("fsdp"))
