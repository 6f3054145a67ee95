"""`ddpkit verify`: the API, the calibrated verdict, the JSON report and the command line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import REPO, run_cli
from torch import nn
from torch.utils.data import TensorDataset

from ddpkit import cli as ddpkit_cli
from ddpkit.errors import DdpkitError
from ddpkit.verify import Tolerance, VerifySpec, cli, verify
from ddpkit.verify.calibrate import deviation, floors, limit

pytestmark = pytest.mark.numerics  # .ci/run runs these again under ATEN_CPU_CAPABILITY=default


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 3))


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(512, 8, generator=g), torch.randint(0, 3, (512,), generator=g))


class TinyTransformer(nn.Module):
    """Two pre-norm encoder layers over 12 tokens: the AdamW case where rounding gets magnified."""

    def __init__(self, vocab: int = 32, d: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x)))


def tokens() -> TensorDataset:
    x = torch.randint(0, 32, (256, 13), generator=torch.Generator().manual_seed(0))
    return TensorDataset(x[:, :-1], x[:, 1:])


def next_token_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


# -- the verdict on correct set-ups -------------------------------------------------------------------
def test_sgd_stays_within_1e_6_relative_norm_and_replicas_are_bitwise_identical(pool2) -> None:
    report = verify(
        VerifySpec(model=mlp, data=data, optimizer="sgd", steps=10, batch_size=32), runner=pool2.run
    )
    assert report.passed and report.replicas_identical, report.render()
    assert max(r.rel_norm for r in report.tensors) < 1e-6
    assert all(r.first_step_over is None and r.excess <= 1 for r in report.tensors)
    assert report.losses["single"] == pytest.approx(report.losses["ddp"], rel=1e-5)


def test_adamw_transformer_stays_within_the_calibrated_floor(pool2) -> None:
    spec = VerifySpec(
        model=TinyTransformer, data=tokens, loss=next_token_loss, optimizer="adamw", steps=8, batch_size=16
    )
    report = verify(spec, runner=pool2.run)
    assert report.passed and report.replicas_identical, report.render()
    assert report.floor["max_rel_norm"] > 0, "rounding noise was measured, not assumed"
    assert all(r.excess <= 1 for r in report.tensors)


@pytest.mark.parametrize(("precision", "largest"), [("fp64", 1e-13), ("bf16", 1e-3)])
def test_other_precisions(precision: str, largest: float, pool2) -> None:
    spec = VerifySpec(model=mlp, data=data, steps=4, batch_size=32, precision=precision)
    report = verify(spec, runner=pool2.run)
    assert report.passed, report.render()
    assert max(r.rel_norm for r in report.tensors) < largest
    assert {r.dtype for r in report.tensors} == {"float64" if precision == "fp64" else "float32"}


@pytest.mark.parametrize("mode,path", [(True, "sharded over 2 ranks"), ("gradients", "reduce-scattered")])
def test_the_sharded_step_and_its_reduce_scatter_train_one_process_weights(pool2, mode, path) -> None:
    """Issue 34: `verify --shard-optimizer` runs s.step(opt) in session(shard_optimizer=...) on both sides;
    the report names the path rank 0 took, and a run where it was not taken cannot pass."""
    spec = VerifySpec(model=mlp, data=data, optimizer="adamw", steps=6, batch_size=32, shard_optimizer=mode)
    report = verify(spec, runner=pool2.run)
    assert report.passed and report.replicas_identical, report.render()
    assert path in report.config["step_path"], report.config["step_path"]
    assert "step (rank 0): optimizer step sharded" in report.render()


def test_report_as_json_and_text(pool2) -> None:
    report = verify(VerifySpec(model=mlp, data=data, steps=2, batch_size=16), runner=pool2.run)
    loaded = json.loads(report.to_json())
    assert loaded["passed"] is True and loaded["config"]["nproc"] == 2
    assert loaded["config"]["model"] == "test_verify:mlp" and loaded["config"]["floor"] == [
        "permuted",
        "chunked",
    ]
    row = loaded["tensors"][0]
    assert set(row) >= {
        "name",
        "max_abs_diff",
        "max_rel_diff",
        "rel_norm",
        "first_step_over",
        "dev_over_update",
    }
    assert set(loaded["tolerance"]) == {"floor_multiple", "eps_multiple", "update_fraction", "min_rel_norm"}
    text = report.render()
    assert "replicas: bitwise identical on all 2 ranks at every step" in text and "verdict: PASS" in text


# -- the calibration, without processes ----------------------------------------------------------------
def test_deviation_measures() -> None:
    a, b = torch.tensor([1.0, -2.0, 0.0, 4.0]), torch.tensor([1.0, -2.5, 0.0, 4.0])
    d = deviation(a, b)
    assert d.max_abs == 0.5 and d.max_rel == 0.25 and d.norm == 0.5
    assert d.rel_norm == pytest.approx(0.5 / math.sqrt(21))
    zero = deviation(torch.zeros(3), torch.tensor([0.0, 1e-30, 0.0]))
    assert zero.rel_norm == math.inf  # any change of an all-zero tensor is infinitely large


def test_floor_is_a_running_maximum_over_variants_and_steps() -> None:
    ref = [{"w": torch.ones(4)}, {"w": torch.ones(4)}, {"w": torch.ones(4)}]
    v1 = [{"w": torch.ones(4)}, {"w": torch.tensor([1.0, 1.0, 1.0, 1.5])}, {"w": torch.ones(4)}]
    v2 = [{"w": torch.ones(4)}, {"w": torch.ones(4)}, {"w": torch.tensor([1.0, 1.0, 1.0, 1.25])}]
    by_step = floors(ref, [v1, v2])
    assert [f["w"][1] for f in by_step] == [0.0, 0.5, 0.5]


def test_tolerance_limits() -> None:
    tol = Tolerance()
    w = torch.full((100,), 2.0)
    eps = torch.finfo(torch.float32).eps
    exact = limit(tol, w, (0.0, 0.0), None)  # a floor of zero: a few ulps, not bitwise equality
    assert exact.rel_norm == pytest.approx(8 * eps) and exact.max_abs == pytest.approx(16 * eps)
    floored = limit(tol, w, (1e-5, 3e-5), None)
    assert floored.rel_norm == pytest.approx(1e-4) and floored.max_abs == pytest.approx(3e-4)
    moved = limit(tol, w, (0.0, 0.0), deviation(w - 0.1, w))  # this step moved every element by 0.1
    assert moved.max_abs == pytest.approx(1e-3) and moved.rel_norm == pytest.approx(0.01 * 0.1 / 2.0)
    assert limit(tol, torch.tensor([3]), (0.0, 0.0), None).max_abs == 0.0  # integer buffers: exact
    assert floored.excess(deviation(w, w + 1e-4)) == pytest.approx(0.5, rel=1e-2)  # 5e-5 of 1e-4 rel norm


# -- usage errors: one paragraph that names the fix ----------------------------------------------------------------
def _lambda_model():
    return lambda: mlp()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batches": "m:f"}, r"exactly one of data .* and batches"),
        ({"nproc": 1}, r"nproc=1: DDP with fewer than 2 ranks has nothing to compare. Pass nproc=2"),
        (
            {"nproc": 4, "batch_size": 30},
            r"global batch 30 does not split evenly over 4 ranks. Use a multiple of 4, e.g. 32",
        ),
        ({"precision": "fp8"}, r"precision='fp8' is not known"),
        ({"model": _lambda_model()}, r"cannot be sent to the DDP ranks .* pass model='module:function'"),
        (
            {"optimizer": "m:f", "optimizer_options": {"lr": 1}},
            r"optimizer_options apply to the built-in optimizers only",
        ),
        ({"floor": ("reversed",)}, r"names no known reference variant"),
        ({"shard_optimizer": "zero3"}, r"shard_optimizer='zero3' is not True, 'auto' or 'gradients'"),
        (
            {"shard_optimizer": True, "strategy": "fsdp"},
            r"FSDP already shards the step. Leave --shard-optimizer out",
        ),
    ],
)
def test_spec_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(DdpkitError, match=message):
        VerifySpec(**{"model": mlp, "data": data, **kwargs})


def test_tolerance_below_the_floor_is_refused() -> None:
    with pytest.raises(DdpkitError, match=r"floor_multiple=0.5.* is out of range. Use floor_multiple >= 1"):
        Tolerance(floor_multiple=0.5)


# -- the command line ---------------------------------------------------------------------------------
def test_cli_pass_writes_json_and_exits_0(tmp_path: Path, pool2, monkeypatch, capsys) -> None:
    # The command line parsed in this process; its DDP side runs on the shared pool instead of new ranks.
    monkeypatch.setattr(cli, "verify", lambda spec: verify(spec, runner=pool2.run))
    out = tmp_path / "report.json"
    argv = ["--model", "test_verify:mlp", "--data", "test_verify:data", "--optimizer", "sgd", "--lr", "0.05"]
    code = cli.main(["--", *argv, "--momentum", "0.9", "--steps", "3", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "verdict: PASS" in text and "0.weight" in text
    report = json.loads(out.read_text())
    assert report["passed"] and report["config"]["optimizer_options"] == {"lr": 0.05, "momentum": 0.9}
    assert cli.main([*argv, "--steps", "1", "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["steps"] == 1


def test_ddpkit_verify_failure_explains_and_exits_1(tmp_path: Path, pool2, monkeypatch, capsys) -> None:
    # `ddpkit verify` as its entry point parses it (the top-level command line dispatches to the tool), its
    # DDP side on the shared pool. The command in a subprocess with ranks of its own (`ddpkit.spawn`),
    # exiting 1 on a failure, is tests/test_invariant.py's and tests/test_compile.py's.
    monkeypatch.setattr(cli, "verify", lambda spec: verify(spec, runner=pool2.run))
    out = tmp_path / "report.json"
    code = ddpkit_cli.main(
        [
            "verify",
            "--",
            "--model",
            "test_verify_diagnose:bn_net",
            "--data",
            "test_verify_diagnose:data",
            "--steps",
            "2",
            "--batch-size",
            "16",
            "--json",
            str(out),
        ]
    )
    stdout = capsys.readouterr().out
    assert code == 1, stdout[-3000:]
    assert "why [batchnorm]" in stdout and "--sync-batchnorm" in stdout
    assert "verdict: FAIL" in stdout
    report = json.loads(out.read_text())
    assert report["passed"] is False and [d["code"] for d in report["diagnoses"]] == ["batchnorm"]
    assert "BatchNorm" in report["config"]["floor_skipped"]["chunked"], "pieces would change its statistics"


def test_cli_usage_error_exits_2_without_starting_ranks() -> None:
    done = run_cli("verify", "--", "--model", "x:y", "--data", "x:z", "--batch-size", "31", cwd=REPO)
    assert done.returncode == 2
    assert "global batch 31 does not split evenly over 2 ranks. Use a multiple of 2, e.g. 32" in done.stderr
