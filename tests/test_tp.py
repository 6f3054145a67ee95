"""Tensor parallelism on 2 gloo ranks (TP(2), no data dimension): training equals one process within
verify's floor (measured here, with the feature-split variant TP needs), from one process's initial
weights bit for bit; ties kept; clipping over DTensor gradients; a wrong plan or a draw ddpkit cannot
give one process's values refused with the layer's name. Rank functions: tests/tp_ranks.py."""

from __future__ import annotations

import functools

import pytest
import torch
from tp_ranks import GPT_PLAN, GPT_VOCAB_PLAN, MLP_PLAN, excess, one_process, refused, train

from ddpkit.strategy.tp_options import TPOptions

pytestmark = pytest.mark.numerics  # compared with one process: the default-kernel leg runs it too


def _reference(kind: str, **kw) -> tuple[dict, list[list[dict]]]:
    """One process, and its noise-floor variants (rows permuted; features summed in 3 pieces)."""
    ref = one_process(kind, **kw)
    variants = [one_process(kind, variant=v, **kw)["states"] for v in ("permuted", "features")]
    return ref, variants


@pytest.mark.parametrize(("kind", "plan"), [("mlp", MLP_PLAN), ("gpt", GPT_PLAN)])
def test_tp2_trains_the_weights_of_one_process_within_the_floor(pool2, kind: str, plan: dict) -> None:
    options = TPOptions(tensor=2, plan=plan, min_block_params=1)
    ranks = pool2.run(train, kind, options, timeout=120)
    ref, variants = _reference(kind)
    got = ranks[0]
    assert got["layout"]["tensor"] == 2 and got["describe"].startswith("TP 2 x FSDP2")
    split = "up.weight" if kind == "mlp" else "blocks.0.attn.q.weight"
    assert len(got["placements"][split]) == 3 and got["placements"][split][-1] == "Shard"  # split on tensor
    for name, a in ref["states"][0].items():  # one process's initial weights, bit for bit
        assert torch.equal(a, got["states"][0][name]), name
    used, where = excess(ref["states"], got["states"], variants)
    assert used <= 1.0, f"{used:.2f} x verify's tolerance at {where}"
    assert got["norms"] == pytest.approx(ref["norms"], rel=1e-5)  # the clip's norm over both meshes
    assert min(ref["norms"]) > 0.5 or kind == "mlp"  # the GPT's clip at 0.5 is active
    assert all(torch.equal(ranks[1]["states"][-1][n], t) for n, t in got["states"][-1].items())


def test_tied_embeddings_stay_one_weight_under_tp(pool2) -> None:
    options = TPOptions(tensor=2, plan=GPT_VOCAB_PLAN, min_block_params=1)
    ranks = pool2.run(functools.partial(train, model_kw={"tied": True}), "gpt", options, timeout=120)
    ref, variants = _reference("gpt", model_kw={"tied": True})
    assert ranks[0]["tied"] == 1 and ranks[0]["placements"]["tok.weight"][-1] == "Shard"
    used, where = excess(ref["states"], ranks[0]["states"], variants)
    assert used <= 1.0, f"{used:.2f} x verify's tolerance at {where}"


def test_a_wrong_plan_or_a_sharded_draw_is_refused_naming_the_layer(pool2) -> None:
    wrong = {**GPT_PLAN, "blocks.*.attn.o": "colwise"}  # a row-wise layer given column-wise
    texts = pool2.run(refused, "gpt", TPOptions(tensor=2, plan=wrong, min_block_params=1), timeout=120)
    assert "the forward of 'blocks.0.attn.o' (split ColwiseParallel" in texts[0], texts[0]
    dropout = TPOptions(tensor=2, plan=GPT_PLAN, min_block_params=1)
    texts = pool2.run(refused, "gpt", dropout, {"attn_dropout": 0.1}, timeout=120)
    assert "on the split output of 'blocks.0.attn.v'" in texts[0] and 'random="per-shard"' in texts[0]
    per_shard = TPOptions(tensor=2, plan=GPT_PLAN, min_block_params=1, random="per-shard")
    assert pool2.run(refused, "gpt", per_shard, {"attn_dropout": 0.1}, timeout=120) == ["no error"] * 2
