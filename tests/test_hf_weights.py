"""Issue 30, item 2: pretrained weights into shards, `s.model(factory, weights=path)`.

The test writes the checkpoint with `save_pretrained` (one file, or an index and several shards) from a
model seeded otherwise than the session, so the loaded weights cannot be the initialisation. Loaded
weights equal the file bit for bit (a copy, no arithmetic). Under FSDP each rank holds only its share;
that each rank *reads* only its own rows is measured by benchmarks/hf_weights_memory.py (peak RSS).
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("CI"):
    import transformers  # noqa: F401  (in CI the test extra installs it: a missing one fails, never skips)
else:
    pytest.importorskip("transformers")

import hf_ranks

import ddpkit


@pytest.mark.parametrize(
    ("kind", "strategy", "shard_size"),
    [("gpt2", "fsdp", None), ("qwen2", "fsdp", "20KB"), ("llama", "ddp", None)],
)
def test_loaded_weights_equal_the_checkpoint(pool2, tmp_path, kind, strategy, shard_size) -> None:
    reference = hf_ranks.pretrained(kind, str(tmp_path / "ckpt"), shard_size)
    if shard_size:
        assert (tmp_path / "ckpt" / "model.safetensors.index.json").is_file()
    want = {n: p.detach() for n, p in reference.named_parameters()}
    want.update({f"buffer:{n}": b for n, b in reference.named_buffers()})
    results = pool2.run(hf_ranks.load, kind, strategy, str(tmp_path / "ckpt"))
    for rank, r in enumerate(results):
        assert set(r["got"]) == set(want)
        differ = [n for n in want if not torch.equal(r["got"][n], want[n])]
        assert differ == [], f"rank {rank}: {differ[:5]} differ from the checkpoint"
        assert r["tied"] == hf_ranks._tied_names(kind)
        total = sum(p.numel() for p in reference.parameters())
        if strategy == "fsdp":
            assert r["local"] <= total // 2 + 200, "a rank holds more than its share"


def test_a_bare_model_checkpoint_is_a_clear_error(tmp_path) -> None:
    """Another architecture's checkpoint is refused by name (a bare model's, whose names lack the prefix,
    loads as from_pretrained loads it: tests/test_fixes_weights.py)."""
    from ddpkit.strategy import weights

    hf_ranks.one_process("llama").save_pretrained(tmp_path)
    with pytest.raises(ddpkit.DdpkitError, match=r"the weights lack .* GPT2LMHeadModel.*names start"):
        weights.load_whole(hf_ranks.factory("gpt2")(), tmp_path)
    with pytest.raises(ddpkit.DdpkitError, match=r"neither a .safetensors file nor a directory"):
        weights.load_whole(hf_ranks.factory("gpt2")(), tmp_path / "nothing")
