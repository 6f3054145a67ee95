"""Mixed precision: the decision table (pure), bf16 autocast on gloo ranks, and the fp16 scaler's skipped
steps (exercised on CPU with a forced PrecisionPlan, since this machine has no CUDA)."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from torch import nn

import ddpkit
from ddpkit.errors import DdpkitError
from ddpkit.parallel.precision import PrecisionPlan, make_scaler, resolve_precision

pytestmark = pytest.mark.numerics  # .ci/run runs these again under ATEN_CPU_CAPABILITY=default


@pytest.mark.parametrize(
    ("requested", "device", "bf16_ok", "name", "dtype", "scaler", "note"),
    [
        ("32", "cpu", True, "32", None, False, None),
        ("fp32", "cuda", True, "32", None, False, None),
        ("bf16", "cpu", True, "bf16", torch.bfloat16, False, None),
        ("bf16-mixed", "cuda", True, "bf16", torch.bfloat16, False, None),
        ("bf16", "cuda", False, "16", torch.float16, True, "no bfloat16 support"),
        ("16", "cuda", True, "16", torch.float16, True, None),
        ("fp16", "cuda", False, "16", torch.float16, True, None),
        ("16", "cpu", True, "bf16", torch.bfloat16, False, "float16 training needs CUDA"),
        ("16-mixed", "cpu", True, "bf16", torch.bfloat16, False, "uses bfloat16 autocast instead"),
    ],
)
def test_precision_decision_table(requested, device, bf16_ok, name, dtype, scaler, note) -> None:
    plan = resolve_precision(requested, device, bf16_supported=bf16_ok)
    assert (plan.name, plan.autocast_dtype, plan.scaler) == (name, dtype, scaler)
    assert (plan.note is None) if note is None else (note in plan.note)
    if device == "cpu":  # building a CUDA scaler needs CUDA
        assert (make_scaler(plan) is not None) == scaler


def test_unknown_precision_names_the_choices() -> None:
    with pytest.raises(DdpkitError, match=r"precision='half' is not known. Use '32' .* 'bf16' .* '16'"):
        resolve_precision("half", "cpu")


def test_fp16_on_cpu_says_what_it_falls_back_to(capsys) -> None:
    with ddpkit.session(precision="16", env={}, hardware=ddpkit.Hardware(gpus=0, cpu_cores=2)) as s:
        assert s.precision.name == "bf16"
    out = capsys.readouterr().out
    assert "precision='16': float16 training needs CUDA" in out and "bfloat16 autocast instead" in out


def test_the_loss_scale_survives_a_checkpoint_round_trip() -> None:
    with ddpkit.session(precision=PrecisionPlan("16", "cpu"), env={}, hardware=ddpkit.Hardware(0, 2)) as s:
        model = s.model(nn.Linear(3, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        s.backward(model(torch.randn(2, 3)).float().sum() * float("inf"))
        assert s.step(opt).skipped
        saved = s.stepper.state_dict()
    assert saved["scaler"]["scale"] == 32768.0 and (saved["steps"], saved["skipped"]) == (1, 1)
    with ddpkit.session(precision=PrecisionPlan("16", "cpu"), env={}, hardware=ddpkit.Hardware(0, 2)) as s:
        s.stepper.load_state_dict(saved)
        assert s.stepper.scaler.get_scale() == 32768.0 and s.skipped_steps == 1


def _data(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)


def bf16_training() -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), ddpkit.session(seed=0, precision="bf16") as s:
        model = s.model(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2)))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        dtypes, losses = set(), []
        for step in range(5):
            x, y = _data(s.rank, step)
            with s.accumulate(model):
                pred = model(x)
                dtypes.add(pred.dtype)
                loss = nn.functional.mse_loss(pred.float(), y)
                s.backward(loss)
            s.step(opt)
            losses.append(loss.item())
        grads_dtype = {p.dtype for p in model.parameters()}
        return {
            "dtypes": dtypes,
            "param_dtypes": grads_dtype,
            "losses": losses,
            "out": out.getvalue(),
            "params": [p.detach().clone() for p in ddpkit.unwrap(model).parameters()],
        }


def test_bf16_autocast_on_cpu_ranks(pool2) -> None:
    r0, r1 = pool2.run(bf16_training)
    assert r0["dtypes"] == {torch.bfloat16}, "the forward ran outside bf16 autocast"
    assert r0["param_dtypes"] == {torch.float32}, "weights must stay fp32"
    assert "precision bf16: autocast bfloat16 on cpu, fp32 weights" in r0["out"] and r1["out"] == ""
    assert all(torch.isfinite(torch.tensor(r0["losses"])))
    for a, b in zip(r0["params"], r1["params"], strict=True):
        assert torch.equal(a, b)


def fp16_skipped_step() -> dict:
    """fp16 autocast + a real GradScaler on CPU; rank 1's loss is inf at step 2: every rank must skip it."""
    out = io.StringIO()
    plan = PrecisionPlan("16", "cpu")
    with contextlib.redirect_stdout(out), ddpkit.session(seed=0, precision=plan) as s:
        model = s.model(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2)))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        infos, params = [], []
        for step in range(4):
            x, y = _data(s.rank, step)
            with s.accumulate(model):
                loss = nn.functional.mse_loss(model(x).float(), y)
                if step == 2 and s.rank == 1:
                    loss = loss * float("inf")
                s.backward(loss)
            infos.append(s.step(opt, max_norm=10.0))
            params.append([p.detach().clone() for p in ddpkit.unwrap(model).parameters()])
        return {"infos": infos, "params": params, "out": out.getvalue(), "skipped": s.skipped_steps}


def test_fp16_scaler_skips_a_step_with_inf_gradients_on_every_rank(pool2) -> None:
    r0, r1 = pool2.run(fp16_skipped_step)
    for r in (r0, r1):
        assert [i.skipped for i in r["infos"]] == [False, False, True, False]
        assert r["skipped"] == 1
        assert all(torch.equal(a, b) for a, b in zip(r["params"][1], r["params"][2], strict=True))
        assert not torch.equal(r["params"][2][0], r["params"][3][0]), "training continues after the skip"
    assert "optimizer step 3 skipped: fp16 gradients held inf/nan; loss scale lowered to 32768" in r0["out"]
    assert r1["out"] == ""
    for a, b in zip(r0["params"][-1], r1["params"][-1], strict=True):
        assert torch.equal(a, b)
