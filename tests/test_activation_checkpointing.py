"""Issue 30, item 3: activation checkpointing, one switch (`s.model(net, activation_checkpointing=Block)`).

Recomputing a block's forward runs the same kernels on the same inputs, so the weights after training are
bitwise those of the run without it (same computation by construction); the test also checks that the
feature was on (each block's forward ran twice per step) and that FSDPOptions(blocks=(Block,)) shards the
checkpoint wrappers (the block is found inside them) without changing a state_dict key.
"""

from __future__ import annotations

import os

import pytest
import recompute_ranks
import torch

import ddpkit


@pytest.mark.numerics
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_recomputed_blocks_train_bitwise_the_same_weights(pool2, strategy: str) -> None:
    plain = pool2.run(recompute_ranks.train, strategy, False)
    recomputed = pool2.run(recompute_ranks.train, strategy, True)
    for a, b in zip(plain, recomputed, strict=True):
        assert b["calls"] == 2 * a["calls"] > 0, "the blocks' forward did not run again in the backward"
        assert a["final"].keys() == b["final"].keys() and a["state_keys"] == b["state_keys"]
        assert [n for n in a["final"] if not torch.equal(a["final"][n], b["final"][n])] == []
    if strategy == "fsdp":
        assert plain[0]["units"] == ["", "1", "2", "3"]  # the three Blocks and the root
        assert recomputed[0]["units"] == ["", "1", "2", "3"]  # the wrappers now, at the blocks' place


@pytest.mark.numerics
def test_a_recompute_draws_the_forwards_dropout_masks(pool2) -> None:
    """Dropout inside every recomputed block: the recompute in the backward must replay the forward's
    random state (the same masks), or the gradients belong to another network and other weights are
    trained. Same seed, same computation by construction: bitwise the run without checkpointing."""
    plain = pool2.run(recompute_ranks.train, "fsdp", False, 3, recompute_ranks.Block, True)
    recomputed = pool2.run(recompute_ranks.train, "fsdp", True, 3, recompute_ranks.Block, True)
    for a, b in zip(plain, recomputed, strict=True):
        assert b["calls"] == 2 * a["calls"] > 0, "the blocks' forward did not run again in the backward"
        assert [n for n in a["final"] if not torch.equal(a["final"][n], b["final"][n])] == []


def test_a_block_fed_the_raw_batch_still_trains(pool2) -> None:
    """nn.Linear recomputed, the first one on the input batch (no requires_grad): the reentrant
    implementation would leave its gradients None (transformers#45518); the non-reentrant one trains it."""
    plain = pool2.run(recompute_ranks.train, "ddp", False, 3, torch.nn.Linear)
    recomputed = pool2.run(recompute_ranks.train, "ddp", True, 3, torch.nn.Linear)
    assert [
        n for n in plain[0]["final"] if not torch.equal(plain[0]["final"][n], recomputed[0]["final"][n])
    ] == []


@pytest.mark.skipif(
    not os.environ.get("CI") and __import__("importlib").util.find_spec("transformers") is None,
    reason="transformers is not installed (pip install 'ddpkit[hf]')",
)
def test_auto_finds_an_hf_models_blocks_and_loads_weights_through_the_wrappers(pool2, tmp_path) -> None:
    import hf_ranks

    hf_ranks.pretrained("gpt2", str(tmp_path))
    plain = pool2.run(recompute_ranks.hf_auto, "fsdp", False, str(tmp_path))
    recomputed = pool2.run(recompute_ranks.hf_auto, "fsdp", True, str(tmp_path))
    assert recomputed[0]["wrapped"] == 2 and plain[0]["wrapped"] == 0  # GPT2Block x 2 layers
    assert [
        n for n in plain[0]["final"] if not torch.equal(plain[0]["final"][n], recomputed[0]["final"][n])
    ] == []


def test_a_class_the_model_lacks_is_a_clear_error() -> None:
    from fsdp_train import net

    from ddpkit.strategy import checkpointing

    with pytest.raises(ddpkit.DdpkitError, match=r"matches no module of the Sequential"):
        checkpointing.apply(net(), torch.nn.LSTM)
    with pytest.raises(ddpkit.DdpkitError, match=r"not a module class"):
        checkpointing.apply(net(), "Block")
