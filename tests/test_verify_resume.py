"""`ddpkit verify --resume`: save, restart, load, train on; compare with no restart.

The command line's check spawns fresh gloo ranks (`ddpkit.spawn`), as a restarted job would be. The other
checks run on the suite's rank pool (2 ranks) and one rank in this process: every run builds its session,
model, optimizer and loader anew and starts from what the checkpoint holds, so the claims (what is
compared, what is named) are the same, at ~0.5 s a run instead of a fresh interpreter's ~5 s.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import run_cli
from torch import nn
from torch.utils.data import TensorDataset

from ddpkit.verify import VerifySpec
from ddpkit.verify.resume import Resumable, ResumeSpec, check

pytestmark = pytest.mark.timeout(240)


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 3))


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(96, 8, generator=g), torch.randint(0, 3, (96,), generator=g))


def momentum(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def decay(step: int) -> float:
    return 0.8**step


def _common(s, model, optimizer, loader, save_scheduler: bool, ema_saved: bool | None) -> Resumable:
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, decay)
    ema = copy.deepcopy(model.module if hasattr(model, "module") else model).requires_grad_(False)

    def after_step() -> None:
        sched.step()
        with torch.no_grad():
            for e, p in zip(ema.parameters(), model.parameters(), strict=True):
                e.lerp_(p, 0.5)

    saved = {"model": model, "optimizer": optimizer, "loader": loader, "stepper": s.stepper}
    others = {}
    (saved if save_scheduler else others)["scheduler"] = sched
    if ema_saved is not None:
        (saved if ema_saved else others)["ema"] = ema
    return Resumable(saved=saved, after_step=after_step, others=others)


def saves_everything(s, model, optimizer, loader) -> Resumable:
    return _common(s, model, optimizer, loader, save_scheduler=True, ema_saved=True)


def forgets_scheduler(s, model, optimizer, loader) -> Resumable:
    """The scheduler is stepped but not passed to s.save, and the check is not told about it."""
    state = _common(s, model, optimizer, loader, save_scheduler=True, ema_saved=True)
    del state.saved["scheduler"]
    return state


def forgets_ema(s, model, optimizer, loader) -> Resumable:
    return _common(s, model, optimizer, loader, save_scheduler=True, ema_saved=False)


def forgets_loader(s, model, optimizer, loader) -> Resumable:
    state = _common(s, model, optimizer, loader, save_scheduler=True, ema_saved=True)
    del state.saved["loader"]
    return state


def spec(setup, **kwargs) -> ResumeSpec:
    base = VerifySpec(model=mlp, data=data, optimizer=momentum, steps=6, batch_size=16)
    return ResumeSpec(spec=base, world=2, setup=setup, save_at=3, **kwargs)


_CALLS = [0]  # after_step calls of this run: every run (the resumed one too) starts again at 0


def one_rounding_step_off(s, model, optimizer, loader) -> Resumable:
    """Everything saved, but every odd after_step call of a process scales the weights by 1 + 2**-23
    (one rounding step of fp32): at step 4 the uninterrupted run is at its 4th call, the resumed run at
    its 1st, so their weights differ by about one unit in the last place, and nothing else differs."""
    state = saves_everything(s, model, optimizer, loader)
    stepped = state.after_step
    _CALLS[0] = 0  # as in a fresh process: the resumed run is a new process in a real restart

    def after_step() -> None:
        stepped()
        _CALLS[0] += 1
        if _CALLS[0] % 2:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(1 + 2**-23)

    state.after_step = after_step
    return state


@pytest.fixture
def runner(pool_runner):
    return pool_runner


def test_a_checkpoint_of_everything_resumes_bitwise(runner) -> None:
    report = check(spec(saves_everything), runner)
    assert report.passed, report.render()
    assert report.compared > 100  # weights, momentum, lr, scheduler, EMA, loader, RNG, data, loss
    # "bitwise" is what the check says it compared; what it did: a resumed run one rounding step off
    # at the same world size fails, at the first weight after the first step on.
    off = check(spec(one_rounding_step_off), runner)
    assert not off.passed, off.render()
    assert off.difference["step"] == 4 and off.difference["key"].startswith("model."), off.render()
    assert "1 of" in off.difference["detail"] or "element(s) differ" in off.difference["detail"]


def test_a_forgotten_scheduler_is_named(runner) -> None:
    report = check(spec(forgets_scheduler), runner)
    assert not report.passed, report.render()
    assert report.difference["step"] == 4 and report.difference["key"] == "optimizer.param_groups.0.lr"
    assert "scheduler" in report.culprit and "scheduler=" in report.fix, report.render()


def test_a_forgotten_ema_is_named_right_after_load(runner) -> None:
    report = check(spec(forgets_ema), runner)
    assert not report.passed
    assert report.difference["step"] == 3 and report.difference["key"].startswith("ema."), report.render()
    assert "EMA" in report.culprit and "not saved" in report.culprit


def test_a_forgotten_loader_position_is_named(runner) -> None:
    report = check(spec(forgets_loader), runner)
    assert not report.passed
    assert report.difference["key"] == "data.global_batch", report.render()
    assert "loader" in report.fix


@pytest.mark.numerics
def test_another_world_size_resumes_within_tolerance(runner) -> None:
    report = check(spec(saves_everything, resume_world=1), runner)
    assert report.passed and not report.bitwise, report.render()
    forgot = check(spec(forgets_scheduler, resume_world=1), runner)
    assert not forgot.passed and "scheduler" in forgot.culprit, forgot.render()


def test_the_command_line(tmp_path) -> None:
    result = run_cli(
        "verify",
        "--resume",
        "--model",
        "test_verify_resume:mlp",
        "--data",
        "test_verify_resume:data",
        "--optimizer",
        "test_verify_resume:momentum",
        "--setup",
        "test_verify_resume:forgets_scheduler",
        "--steps",
        "6",
        "--batch-size",
        "16",
        "--save-at",
        "3",
        timeout=200,
        cwd=tmp_path,
        env={"PYTHONPATH": f"{__file__.rsplit('/', 1)[0]}:{__file__.rsplit('/', 2)[0]}"},
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "scheduler" in result.stdout and "verdict: FAIL" in result.stdout


def batch_of_step(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)


@pytest.mark.numerics
def test_the_default_checkpoint_of_a_batches_spec_on_one_rank(runner) -> None:
    """No setup: model, optimizer and s.stepper are saved; the batches follow the saved step."""
    base = VerifySpec(model=mlp, batches=batch_of_step, optimizer="adamw", steps=4, batch_size=16)
    report = check(ResumeSpec(spec=base, world=1, resume_world=2), runner)
    assert report.passed and not report.bitwise, report.render()
    assert check(ResumeSpec(spec=base, world=1), runner).passed
