"""`ddpkit verify` with a tensor degree, on the command line, 4 ranks from the pool: FSDP(2) x TP(2) of a
Hugging Face Llama (its own plan) passes within the floor of one process (the features variant added,
the one TP needs), and the same Llama with a planted wrong plan (a row-wise layer given column-wise)
fails, naming the layer. Rank functions: tests/tp_ranks.py."""

from __future__ import annotations

import pickle

import pytest

pytestmark = pytest.mark.numerics  # compared with one process: the default-kernel leg runs it too

ARGS = ["--data", "tp_ranks:token_data", "--loss", "tp_ranks:lm_loss", "--optimizer", "adamw", "--nproc", "4"]
ARGS += ["--strategy", "tp", "--tensor-degree", "2", "--steps", "3", "--batch-size", "8"]


def _cli(pool4, monkeypatch, ran: list[str]):
    from ddpkit.verify import cli, verify

    def runner(fn, spec):
        results = pool4.run(fn, spec, timeout=240)
        ran.extend(pickle.loads(r).strategy for r in results)
        return results

    monkeypatch.setattr(cli, "verify", lambda spec: verify(spec, runner=runner))
    return cli


def test_verify_tensor_degree_passes_fsdp2_x_tp2_llama(pool4, monkeypatch, capsys) -> None:
    ran: list[str] = []
    cli = _cli(pool4, monkeypatch, ran)
    code = cli.main(["--model", "tp_ranks:llama", *ARGS, "--json", "-"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert '"passed": true' in out, out
    assert ran == ["TP 2 x FSDP2 (replicate 1 x shard 2 x tensor 2)"] * 4, ran


def test_verify_fails_a_planted_wrong_plan(pool4, monkeypatch, capsys) -> None:
    cli = _cli(pool4, monkeypatch, [])
    code = cli.main(["--model", "tp_ranks:wrong_llama", *ARGS, "--json", "-"])
    out = capsys.readouterr().out
    assert code != 0 and '"passed": false' in out
    assert "the forward of 'model.layers.0.self_attn.o_proj' (split ColwiseParallel" in out, out[-3000:]


def test_the_tensor_flags_set_the_shapes_verify_and_plan_run(monkeypatch, capsys) -> None:
    """`--tensor-degree` and `--resume-tensor-degree` lay out "tp" by the library's one builder;
    `plan --memory --tensor-degree` reaches the tensor-parallel plan (a model without one: refused in one
    paragraph; the estimate itself: tests/test_plan_tp_shapes.py)."""
    from test_options_cli_verify import BASE, _handed

    from ddpkit.plan import cli as plan_cli

    kind, spec, _ = _handed(monkeypatch, *BASE, "--strategy", "tp", "--tensor-degree", "2", "--nproc", "4")
    assert kind == "verify" and spec.part.describe() and spec.part.layout.tensor == 2
    assert (spec.part.layout.replicate, spec.part.layout.shard) == (1, 2)
    resumed = ["--resume", "--nproc", "4", "--resume-nproc", "2", "--resume-strategy", "tp"]
    kind, rs, _ = _handed(monkeypatch, *BASE, *resumed, "--resume-tensor-degree", "2")
    assert kind == "resume" and rs.parts[1].layout.tensor == 2 and rs.parts[1].layout.data == 1
    args = ["--memory", "--model", "mlp", "--world", "4", "--strategy", "tp", "--tensor-degree", "2"]
    code = plan_cli.main([*args, "--global-batch", "8"])
    err = capsys.readouterr().err
    assert code != 0 and "has no tensor-parallel plan of its own" in err, err
