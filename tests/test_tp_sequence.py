"""Sequence parallelism on a Hugging Face Llama from its config, 2 gloo ranks: its own tensor-parallel
plan names only the embedding and the linear layers; ddpkit derives the rest (each norm SequenceParallel
on its rank's positions, its weight a DTensor over the tensor ranks; each attention and MLP gathering the
sequence-sharded stream first), and training equals one process within verify's floor; on 4 ranks the
same with FSDP(2) x TP(2), loss parallel and accumulation. Rank functions: tests/tp_training_ranks.py."""

from __future__ import annotations

import functools

import pytest
from tp_ranks import excess
from tp_training_ranks import train_tp

from ddpkit.strategy.tp_options import TPOptions

pytestmark = pytest.mark.numerics  # compared with one process: the default-kernel leg runs it too


def test_sequence_parallel_trains_an_hf_llama_as_one_process(pool2) -> None:
    options = TPOptions(tensor=2, min_block_params=1, sequence_parallel=True)  # plan="auto": HF's own
    got = pool2.run(train_tp, "llama", options, timeout=300)[0]
    assert "LlamaForCausalLM's own" in got["printed"] and "sequence parallel" in got["printed"]
    for norm in ("model.norm", "model.layers.0.input_layernorm", "model.layers.1.post_attention_layernorm"):
        assert len(got["placements"][f"{norm}.weight"]) == 3, norm  # on the tensor mesh too: SP's norm
    ref = train_tp("llama", None)
    variants = [train_tp("llama", None, variant=v)["states"] for v in ("permuted", "features")]
    used, where = excess(ref["states"], got["states"], variants)
    assert used <= 1.0, f"{used:.2f} x verify's tolerance at {where}"
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5)


def test_fsdp2_x_tp2_with_sequence_and_loss_parallel_trains_the_llama_as_one_process(pool4) -> None:
    """All of it on 4 ranks: FSDP(2) x TP(2), the stream sharded along the sequence, the logits along the
    vocabulary (the loss inside torch's loss_parallel()), 2 micro-batches per step."""
    options = TPOptions(tensor=2, min_block_params=1, sequence_parallel=True, loss_parallel=True)
    run = functools.partial(train_tp, how="parallel", accumulation=2)
    got = pool4.run(run, "llama", options, timeout=300)[0]
    assert (got["layout"]["shard"], got["layout"]["tensor"]) == (2, 2)
    assert got["loss_types"] == ["DTensor"] * 6 and "sequence parallel, loss parallel" in got["printed"]
    ref = train_tp("llama", None, accumulation=2)
    variants = [
        train_tp("llama", None, accumulation=2, variant=v)["states"] for v in ("permuted", "features")
    ]
    used, where = excess(ref["states"], got["states"], variants)
    assert used <= 1.0, f"{used:.2f} x verify's tolerance at {where}"
    assert got["norms"] == pytest.approx(ref["norms"], rel=1e-5)
