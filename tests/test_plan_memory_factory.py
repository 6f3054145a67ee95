"""`plan --memory --model pkg:factory` where the factory returns a Hugging Face model: its config says its
inputs (token ids over its vocabulary, the sequence from its positions or --seq-len), as `hf:TYPE` does,
so it is planned instead of refused as a plain module; a plain module is still refused."""

from __future__ import annotations

import pytest
from torch import nn

from ddpkit.errors import DdpkitError
from ddpkit.plan import memory_cli
from ddpkit.plan.memory import MemoryJob, estimate

transformers = pytest.importorskip("transformers")

SIZES = {"n_layer": 2, "n_embd": 128, "n_head": 2, "n_positions": 128, "vocab_size": 256}
SPEC = "hf:gpt2," + ",".join(f"{k}={v}" for k, v in {**SIZES, "bos_token_id": 0, "eos_token_id": 0}.items())


def make_gpt2() -> nn.Module:
    """A user's factory: the model built from its config (offline)."""
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**SIZES, bos_token_id=0, eos_token_id=0))


def make_plain() -> nn.Module:
    return nn.Linear(4, 2)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_factorys_hugging_face_model_is_planned_as_its_config_names_it(strategy: str) -> None:
    job = dict(micro_batch=4, seq_len=64, world=2, strategy=strategy)
    by_factory = estimate(MemoryJob(model=f"{__name__}:make_gpt2", **job))
    by_type = estimate(MemoryJob(model=SPEC, **job))
    assert by_factory.parameters == by_type.parameters > 0
    assert by_factory.activations == by_type.activations > 0  # the same inputs: ids of 64 tokens


def test_the_command_line_plans_the_factory_and_still_refuses_a_plain_module(capsys) -> None:
    assert memory_cli.main(["--model", f"{__name__}:make_gpt2", "--micro-batch", "2", "--seq-len", "32"]) == 0
    out = capsys.readouterr().out
    assert "sequence 32" in out and "peak per rank at micro-batch 2" in out
    with pytest.raises(DdpkitError, match=r"plain nn\.Module"):
        estimate(MemoryJob(model=f"{__name__}:make_plain", micro_batch=2))
