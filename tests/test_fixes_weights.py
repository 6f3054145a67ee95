"""`s.model(factory, weights=dir)` reads a transformers checkpoint under the names `from_pretrained` gives
its keys: `save_pretrained` writes a ViT's legacy names (`vit.encoder.layer.0.attention.attention.query`
for the model's `vit.layers.0.attention.q_proj`: transformers' conversion mapping, reversed on save), and a
checkpoint of the whole model loads into its bare base model (the `vit.` prefix dropped) or the other way
round (GPT-2's `transformer.` added). Tiny configs, written in the test; nothing from a hub."""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("CI"):
    import transformers  # noqa: F401  (in CI the test extra installs it: a missing one fails, never skips)
else:
    pytest.importorskip("transformers")

import hf_ranks
from fsdp_train import full_params

import ddpkit
from ddpkit.strategy import FSDPOptions, weights


def load_fsdp(kind: str, path: str) -> dict:
    """s.model(factory, strategy=FSDP, weights=path) on this rank: the weights gathered, the rows held."""
    with ddpkit.session(seed=0, verbose=False) as s:
        model = s.model(hf_ranks.factory(kind), strategy=FSDPOptions(min_block_params=10_000), weights=path)
        held = sum(p.to_local().numel() for p in ddpkit.unwrap(model).parameters())
        return {"got": full_params(model), "local": held}


def test_a_vit_saved_by_save_pretrained_loads_into_fsdp_shards(pool2, tmp_path) -> None:
    reference = hf_ranks.pretrained("vit", str(tmp_path / "vit"))  # other weights than the seed-0 init
    from safetensors import safe_open

    with safe_open(str(tmp_path / "vit" / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    names = {n for n, _ in reference.named_parameters()}
    assert "vit.encoder.layer.0.attention.attention.query.weight" in keys, "the file's legacy names"
    assert "vit.layers.0.attention.q_proj.weight" in names and not names <= keys, (
        "renamed, or nothing to test"
    )
    want = {n: p.detach() for n, p in reference.named_parameters()}
    for rank, r in enumerate(pool2.run(load_fsdp, "vit", str(tmp_path / "vit"), timeout=90)):
        assert set(r["got"]) == set(want)
        differ = [n for n in want if not torch.equal(r["got"][n], want[n])]
        assert differ == [], f"rank {rank}: {differ[:5]} differ from the checkpoint"
        assert r["local"] <= sum(p.numel() for p in reference.parameters()) // 2 + 200, "not sharded"


def test_the_base_model_prefix_is_dropped_or_added_as_from_pretrained_does(tmp_path) -> None:
    import transformers as tf

    reference = hf_ranks.pretrained("vit", str(tmp_path / "vit"))
    bare = tf.ViTModel(hf_ranks.config("vit"), add_pooling_layer=False)  # the classifier's backbone
    assert weights.load_whole(bare, tmp_path / "vit") == len(bare.state_dict())
    assert torch.equal(bare.layers[1].mlp.fc2.weight, reference.vit.layers[1].mlp.fc2.weight)
    assert torch.equal(bare.embeddings.cls_token, reference.vit.embeddings.cls_token)

    base = tf.GPT2Model(hf_ranks.config("gpt2"))
    base.save_pretrained(tmp_path / "gpt2")  # names without `transformer.`
    head = hf_ranks.factory("gpt2")()
    weights.load_whole(head, tmp_path / "gpt2")
    assert torch.equal(head.transformer.h[1].mlp.c_fc.weight, base.h[1].mlp.c_fc.weight)
    assert torch.equal(head.lm_head.weight, base.wte.weight), "the tied head"
