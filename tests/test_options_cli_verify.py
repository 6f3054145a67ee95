"""Every flag of `ddpkit verify` reaches the check that runs (tests/options/cli.toml).

A verify run trains the model twice (one process, then N ranks) for seconds to minutes; what each flag
changes there is the checks' own tests' (tests/test_verify*.py, tests/test_invariant.py, tests/test_hsdp*.py).
Here the command line runs in this process up to the check and the test reads the spec handed to it:
`ddpkit.verify.verify(spec)`, `ddpkit.verify.resume.check(resume_spec)` or
`ddpkit.verify.bitwise.check(spec, chunk=)`, whichever the flags choose. Each flag is set away from its
default, so a flag the command drops leaves the default in the spec and fails its row.
"""

from __future__ import annotations

from typing import Any

import pytest

from ddpkit.verify import bitwise, cli, resume
from ddpkit.verify.spec import Tolerance

BASE = ("--model", "test_verify:mlp", "--data", "test_verify:data")


class Ran(Exception):
    """What the command handed to the check (the check itself never runs)."""


def _handed(monkeypatch: pytest.MonkeyPatch, *argv: str) -> tuple[str, Any, dict[str, Any]]:
    """`ddpkit verify ARGV`: which check it runs, the spec it hands over, and the check's keywords."""

    def check(kind: str):
        def stop(spec: Any, **kwargs: Any) -> None:
            raise Ran(kind, spec, kwargs)

        return stop

    monkeypatch.setattr(cli, "verify", check("verify"))
    monkeypatch.setattr(resume, "check", check("resume"))
    monkeypatch.setattr(bitwise, "check", check("bitwise"))
    with pytest.raises(Ran) as ran:
        cli.main(list(argv))
    return ran.value.args


# (flags, spec field, value in the spec): the field's default differs from the value
ROWS: list[tuple[tuple[str, ...], str, Any]] = [
    (BASE, "model", "test_verify:mlp"),
    (BASE, "data", "test_verify:data"),
    (
        ("--model", "test_verify:mlp", "--batches", "test_verify_resume:batch_of_step"),
        "batches",
        "test_verify_resume:batch_of_step",
    ),
    ((*BASE, "--loss", "mse"), "loss", "mse"),
    ((*BASE, "--optimizer", "adamw"), "optimizer", "adamw"),
    ((*BASE, "--lr", "0.5"), "optimizer_options", {"lr": 0.5}),
    ((*BASE, "--momentum", "0.5"), "optimizer_options", {"momentum": 0.5}),
    ((*BASE, "--weight-decay", "0.5"), "optimizer_options", {"weight_decay": 0.5}),
    ((*BASE, "--nproc", "4"), "nproc", 4),
    ((*BASE, "--steps", "3"), "steps", 3),
    ((*BASE, "--batch-size", "16"), "batch_size", 16),
    ((*BASE, "--no-shuffle"), "shuffle", False),
    ((*BASE, "--precision", "bf16"), "precision", "bf16"),
    ((*BASE, "--seed", "7"), "seed", 7),
    ((*BASE, "--device", "auto"), "device", "auto"),
    ((*BASE, "--strategy", "fsdp"), "strategy", "fsdp"),
    ((*BASE, "--strategy", "hsdp", "--nproc", "4", "--shard-degree", "2"), "shard", 2),
    ((*BASE, "--sync-batchnorm"), "sync_batchnorm", True),
    ((*BASE, "--find-unused-parameters"), "find_unused_parameters", True),
    ((*BASE, "--static-graph"), "static_graph", True),
    ((*BASE, "--compile"), "compile", True),
    ((*BASE, "--shard-optimizer", "gradients"), "shard_optimizer", "gradients"),
    ((*BASE, "--shard-optimizer", "true"), "shard_optimizer", True),
    (
        (*BASE, "--after-wrap", "test_verify_diagnose:load_checkpoint_on_main_only"),
        "after_wrap",
        "test_verify_diagnose:load_checkpoint_on_main_only",
    ),
    ((*BASE, "--floor", "permuted, threads"), "floor", ("permuted", "threads")),
    ((*BASE, "--floor-multiple", "20"), "tolerance", Tolerance(floor_multiple=20.0)),
    ((*BASE, "--eps-multiple", "16"), "tolerance", Tolerance(eps_multiple=16.0)),
    ((*BASE, "--timeout", "42"), "timeout", 42.0),
]


def test_verify_flags_set_the_spec_that_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    for flags, field, value in ROWS:
        kind, spec, _ = _handed(monkeypatch, *flags)
        assert kind == "verify" and getattr(spec, field) == value, (flags, getattr(spec, field))


def test_verify_resume_flags_set_the_resumed_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    kind, rs, _ = _handed(monkeypatch, *BASE, "--resume", "--steps", "6", "--timeout", "42")
    assert kind == "resume" and (rs.world, rs.resume_world, rs.save_at, rs.setup) == (2, None, None, None)
    assert rs.timeout == 42.0 and rs.k == 3  # the step saved: half the steps by default
    kind, rs, _ = _handed(
        monkeypatch,
        *BASE,
        "--resume",
        "--nproc",
        "4",
        "--resume-nproc",
        "2",
        "--resume-strategy",
        "hsdp",
        "--resume-shard-degree",
        "2",
        "--save-at",
        "4",
        "--setup",
        "test_verify_resume:forgets_scheduler",
    )
    assert (rs.world, rs.resume_world, rs.save_at, rs.k) == (4, 2, 4, 4)
    assert rs.setup == "test_verify_resume:forgets_scheduler"
    assert tuple(part.describe() for part in rs.parts) == ("DDP(4)", "HSDP(1x2)")


def test_verify_bitwise_runs_the_bitwise_check_with_its_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    kind, spec, options = _handed(monkeypatch, *BASE, "--bitwise", "--nproc", "4")
    assert kind == "bitwise" and spec.nproc == 4 and options == {"chunk": 4}
    assert _handed(monkeypatch, *BASE, "--bitwise", "--chunk", "2")[2] == {"chunk": 2}
