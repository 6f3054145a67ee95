"""LoRA adapters (peft) on a tensor-parallel Hugging Face Llama, 2 gloo ranks: the model's own plan lands
on each LoRA layer's base layer, the adapters split so that their product is split as the base's output
is (lora_B column-wise under a column-wise base, lora_A row-wise under a row-wise one), and training the
adapters equals one process within verify's floor. Rank functions: tests/tp_ranks.py."""

from __future__ import annotations

import pytest
from tp_ranks import excess, one_process, train

from ddpkit.strategy.tp_options import TPOptions

pytestmark = pytest.mark.numerics  # compared with one process: the default-kernel leg runs it too


def test_lora_adapters_train_on_a_tp_llama_as_in_one_process(pool2) -> None:
    options = TPOptions(tensor=2, min_block_params=1)
    ranks = pool2.run(train, "lora", options, timeout=120)
    ref = one_process("lora")
    variants = [one_process("lora", variant=v)["states"] for v in ("permuted", "features")]
    got = ranks[0]
    where = "base_model.model.model.layers.0.self_attn"
    assert got["placements"][f"{where}.q_proj.base_layer.weight"][-1] == "Shard"
    assert got["placements"][f"{where}.q_proj.lora_B.default.weight"][-1] == "Shard"
    assert len(got["placements"][f"{where}.q_proj.lora_A.default.weight"]) == 2  # whole: the data mesh only
    assert got["placements"][f"{where}.o_proj.lora_A.default.weight"][-1] == "Shard"
    used, at = excess(ref["states"], got["states"], variants)
    assert used <= 1.0, f"{used:.2f} x verify's tolerance at {at}"
    moved = [
        n
        for n in ref["states"][0]
        if "lora_" in n and not (ref["states"][0][n] == ref["states"][-1][n]).all()
    ]
    assert moved  # the adapters trained
