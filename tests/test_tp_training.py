"""Training under tensor parallelism beyond the plain step, on gloo ranks against one process: loss
parallel (the cross entropy on vocabulary-sharded logits inside torch's loss_parallel(), never gathered),
and the counts a loop makes over the data-parallel ranks only (the ranks of a tensor group read one
batch): token-weighted losses, evaluation's sums, the spike guard's own gradient norm; the start-up line
names the mesh of TP alone. Rank functions: tests/tp_training_ranks.py."""

from __future__ import annotations

import functools

import pytest
import torch
from tp_ranks import GPT_PLAN, GPT_VOCAB_PLAN, batches, excess, refused
from tp_training_ranks import labels_of, refused_outside, train_tp

import ddpkit
from ddpkit.strategy.tp_options import TPOptions

pytestmark = pytest.mark.numerics  # compared with one process: the default-kernel leg runs it too


def _reference(kind: str, **kw) -> tuple[dict, list[list[dict]]]:
    """One process, and its noise-floor variants (rows permuted; features summed in 3 pieces)."""
    ref = train_tp(kind, None, **kw)
    kw.pop("evaluate", None)
    variants = [train_tp(kind, None, variant=v, **kw)["states"] for v in ("permuted", "features")]
    return ref, variants


@pytest.mark.parametrize(
    ("kind", "options"),
    [
        ("gpt", TPOptions(tensor=2, plan=GPT_VOCAB_PLAN, min_block_params=1, loss_parallel=True)),
        ("llama", TPOptions(tensor=2, min_block_params=1, loss_parallel=True)),  # HF's plan and loss
    ],
    ids=["gpt", "llama"],
)
def test_loss_parallel_trains_as_one_process_without_gathering_the_logits(pool2, kind, options) -> None:
    got = pool2.run(functools.partial(train_tp, how="parallel"), kind, options, timeout=200)[0]
    assert got["loss_types"] == ["DTensor"] * 3  # computed on the sharded logits, in torch's context
    assert got["placements"]["lm_head.weight"][-1] == "Shard"
    assert "loss parallel: the logits of lm_head stay sharded" in got["printed"]
    ref, variants = _reference(kind)
    used, where = excess(ref["states"], got["states"], variants)
    assert used <= 1.0, f"{used:.2f} x verify's tolerance at {where}"
    assert got["norms"] == pytest.approx(ref["norms"], rel=1e-5)
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5)


def test_loss_parallel_refuses_a_forward_outside_its_context_and_a_plan_without_a_sharded_head(pool2):
    options = TPOptions(tensor=2, plan=GPT_VOCAB_PLAN, min_block_params=1, loss_parallel=True)
    texts = pool2.run(refused_outside, options, timeout=120)
    assert "the training forward ran outside torch's loss_parallel() context" in texts[0], texts[0]
    assert texts[0] == texts[1]
    no_head = TPOptions(tensor=2, plan=GPT_PLAN, min_block_params=1, loss_parallel=True)
    texts = pool2.run(refused, "gpt", no_head, timeout=120)
    assert "splits no head over the vocabulary" in texts[0] and "'colwise_gather_output'" in texts[0]


GUARDED = dict(
    how="tokens",
    accumulation=2,
    steps=2,
    max_norm=None,  # the spike guard computes the norm itself
    session_kw={"spike_guard": ddpkit.SpikeGuard(warmup=2, window=4)},
)


def _unequal_micro_batches() -> bool:
    """The token counts of the two micro-batches of a step differ (so a mean of their means is not the
    token mean a one-process run of the whole batch takes: the weighting is what makes them agree)."""
    counts = [int((labels_of(x) != -100).sum()) for x in batches("gpt", 2)]
    return counts[0] != counts[1]


@pytest.mark.parametrize(("world", "tensor"), [(2, 2), (4, 2)], ids=["tp2", "fsdp2xtp2"])
def test_tokens_evaluation_and_the_guards_norm_count_over_the_data_ranks(pool2, pool4, world, tensor):
    options = TPOptions(tensor=tensor, plan=GPT_PLAN, min_block_params=1)
    pool = pool2 if world == 2 else pool4
    ranks = pool.run(functools.partial(train_tp, evaluate=True, **GUARDED), "gpt", options, timeout=240)
    got = ranks[0]
    mesh = "mesh replicate 1 x shard 1 x tensor 2" if world == 2 else "mesh replicate 1 x shard 2 x tensor 2"
    assert f"strategy tp over {world} rank(s), {mesh}" in got["printed"], got["printed"]
    ref, variants = _reference("gpt", evaluate=True, **GUARDED)
    assert _unequal_micro_batches()
    used, where = excess(ref["states"], got["states"], variants)  # the global token mean, as one process
    assert used <= 1.0, f"{used:.2f} x verify's tolerance at {where}"
    assert len(got["norms"]) == 2 and got["norms"] == pytest.approx(ref["norms"], rel=1e-5)  # the guard's
    sums, want = got["sums"], ref["sums"]
    assert (sums["rows"], sums["tokens"]) == (want["rows"], want["tokens"]) == (32, want["tokens"])
    assert sums["loss_sum"] == pytest.approx(want["loss_sum"], rel=1e-5)
    assert sums["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert all(r["sums"] == sums for r in ranks)
    assert all(torch.equal(ranks[-1]["states"][-1][n], t) for n, t in got["states"][-1].items())
