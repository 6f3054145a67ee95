"""Issue 29's "one route per value", checked from outside: each fact has one owner, and the owner is
the one that answers (no processes here; the walks themselves run in test_checkpoint, test_preemption,
test_background_save and test_precision)."""

from __future__ import annotations

import dataclasses
import signal
from pathlib import Path

import pytest
import torch
from torch import nn

import ddpkit
from ddpkit.checkpoint.write import Snapshot
from ddpkit.cluster import failures
from ddpkit.cluster.launch import LaunchConfig
from ddpkit.cluster.preemption import Preempted
from ddpkit.cluster.signals import PreemptionOptions, signal_of
from ddpkit.errors import DdpkitError
from ddpkit.names import PREEMPTED_EXIT_CODE, PREEMPTION_SIGNAL_ENV, REQUEUE_ENV
from ddpkit.parallel.precision import FP32, PrecisionPlan


def test_one_rule_for_a_signal_name_in_the_launcher_and_the_ranks(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    for name in ("10", "USR9", "SIGUSR1;rm"):
        with pytest.raises(DdpkitError, match="is not a signal name") as in_rank:
            PreemptionOptions(signal=name)
        with pytest.raises(DdpkitError, match="is not a signal name") as in_launcher:
            LaunchConfig(target=str(script), preemption_signal=name)
        assert str(in_rank.value) == str(in_launcher.value)  # the same owner says it
    assert signal_of("usr2") == signal_of("SIGUSR2") == signal.SIGUSR2


def test_requeue_is_parsed_once_and_travels_to_the_ranks_unchanged(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    for text, meaning in (("auto", "auto"), ("1", True), ("0", False)):
        policy = LaunchConfig(target=str(script), requeue=text, preemption_signal="sigusr2").stop_policy
        env = policy.env()
        assert env == {PREEMPTION_SIGNAL_ENV: "USR2", REQUEUE_ENV: text}
        assert PreemptionOptions.from_env(env) == policy and policy.requeue == meaning
    with pytest.raises(DdpkitError, match="requeue 'yes' is not one of auto, 1, 0"):
        PreemptionOptions(requeue="yes")


def test_a_clean_preemption_is_not_recorded_as_a_failure() -> None:
    stop = Preempted(24, Path("ckpt-000004"), "SIGTERM")
    assert stop.code == PREEMPTED_EXIT_CODE and failures.stopped_cleanly(stop)
    seen = len(failures._seen)
    failures.record_failure(stop, 0)
    assert len(failures._seen) == seen, "a preemption that saved was recorded as a failure"
    assert not failures.stopped_cleanly(SystemExit(1)) and not failures.stopped_cleanly(ValueError())


def test_a_save_before_s_model_builds_the_strategy_in_the_session_and_hands_a_value(tmp_path: Path) -> None:
    with ddpkit.session(seed=0, env={}, verbose=False, log_to=None) as s:
        assert s._choosing.strategy is None  # not built yet: "auto" waits for s.model
        s.save(str(tmp_path / "ck"), step=1)
        context = s.checkpoints._ctx
        assert context.strategy is s.strategy and context.optimizers is s.stepper
        with pytest.raises(dataclasses.FrozenInstanceError):
            context.rank = 1  # type: ignore[misc]
        assert not any(
            callable(getattr(context, f.name)) and f.name not in ("say", "barrier")
            for f in dataclasses.fields(context)
        )
        model = s.model(nn.Linear(3, 2))
        assert s.strategy is context.strategy  # the one strategy, not rebuilt by s.model
        assert s.load(str(tmp_path / "ck"), model=None, step=0)["step"] == 1
    assert dataclasses.is_dataclass(Snapshot) and Snapshot.__dataclass_params__.frozen  # type: ignore[attr-defined]
    assert isinstance(model, nn.Module)


def test_the_loss_scale_is_driven_by_its_owner() -> None:
    plan = PrecisionPlan("16", "cpu")
    scale = plan.loss_scale()
    net = nn.Linear(2, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scale.scale(net(torch.ones(1, 2)).sum() * float("inf")).backward()
    scale.unscale(opt)
    before = scale.get_scale()
    assert scale.step(opt, lambda update: update()) and scale.get_scale() < before  # skipped, lowered
    passthrough = FP32.loss_scale()
    assert not passthrough.active and passthrough.step(opt, lambda update: update()) is False


def test_ddpkit_variables_are_spelled_only_in_names() -> None:
    import ast
    import re

    package = Path(ddpkit.__file__).parent
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.name == "names.py" and path.parent == package:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            spelled = isinstance(node, ast.Constant) and isinstance(node.value, str)
            if spelled and re.fullmatch(r"DDPKIT_[A-Z0-9_]+", node.value):
                found.append(f"{path.relative_to(package)}:{node.lineno} {node.value}")
    assert not found, f"DDPKIT_* variables spelled outside ddpkit/names.py: {found}"
