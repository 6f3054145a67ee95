"""Sequence parallelism on a Hugging Face Llama from its config, 2 gloo ranks: its own tensor-parallel
plan names only the embedding and the linear layers; ddpkit derives the rest (each norm SequenceParallel
on its rank's positions, its weight a DTensor over the tensor ranks; each attention and MLP gathering the
sequence-sharded stream first), and training equals one process within verify's floor. Rank functions:
tests/tp_training_ranks.py."""

from __future__ import annotations

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
