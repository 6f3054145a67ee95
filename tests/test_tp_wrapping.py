"""What s.model and the session add around tensor parallelism, on 2 gloo ranks against one process:
activation checkpointing (the plan reaches the layers through the checkpoint wrappers; the recompute
gives the same values), bf16 autocast (within bf16's own floor) and torch.compile (each block compiled
after the split: graphs made, no silent fall back to eager), a dropout under compile refused. Rank
functions: tests/tp_training_ranks.py."""

from __future__ import annotations

import functools

import pytest
from tp_ranks import GPT_PLAN, Block, excess
from tp_training_ranks import refused_compile, train_tp

from ddpkit.strategy.tp_options import TPOptions

pytestmark = pytest.mark.numerics  # compared with one process: the default-kernel leg runs it too

OPTIONS = TPOptions(tensor=2, plan=GPT_PLAN, blocks=(Block,))


def _within_floor(got: dict, steps: int = 3, **kw) -> None:
    ref = train_tp("gpt", None, steps=steps, **kw)
    variants = [
        train_tp("gpt", None, steps=steps, variant=v, **kw)["states"] for v in ("permuted", "features")
    ]
    used, where = excess(ref["states"], got["states"], variants)
    assert used <= 1.0, f"{used:.2f} x verify's tolerance at {where}"


def test_activation_checkpointing_under_tp_trains_as_one_process(pool2) -> None:
    run = functools.partial(train_tp, wrap_kw={"activation_checkpointing": Block})
    got = pool2.run(run, "gpt", OPTIONS, timeout=200)[0]
    assert "activation checkpointing: 2 Block module(s)" in got["printed"]
    assert got["placements"]["blocks.0.attn.q.weight"][-1] == "Shard"  # split through the wrapper
    _within_floor(got)


def test_bf16_under_tp_trains_as_one_process_in_bf16(pool2) -> None:
    """Plain SGD: AdamW's first steps turn any rounding of a near-zero gradient into a whole update of
    the other sign, which bf16's rounding does everywhere (no floor variant then says anything)."""
    kw = dict(session_kw={"precision": "bf16"}, sgd=True)
    got = pool2.run(functools.partial(train_tp, **kw), "gpt", OPTIONS, timeout=200)[0]
    assert "precision bf16: autocast bfloat16 on cpu, fp32 weights" in got["printed"]
    assert got["output_dtypes"] == ["torch.bfloat16"]  # the model's output: bf16 autocast was active
    _within_floor(got, **kw)


def test_compile_under_tp_compiles_each_block_and_trains_as_one_process(pool2) -> None:
    run = functools.partial(train_tp, steps=2, wrap_kw={"compile": True})
    ranks = pool2.run(run, "gpt", OPTIONS, timeout=300)
    assert all(r["graphs"]["graphs"] > 0 for r in ranks), [r["graphs"] for r in ranks]  # compiled
    assert "block(s) + the root, compiled" in ranks[0]["printed"], ranks[0]["printed"]
    _within_floor(ranks[0], steps=2)
    texts = pool2.run(refused_compile, OPTIONS, {"dropout": 0.1}, timeout=120)
    assert "compile= with tensor parallelism, and 'blocks.0.drop1' has a dropout" in texts[0], texts[0]
    per_shard = TPOptions(tensor=2, plan=GPT_PLAN, blocks=(Block,), random="per-shard")
    assert pool2.run(refused_compile, per_shard, {"dropout": 0.1}, timeout=120) == ["no error"] * 2
