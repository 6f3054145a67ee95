"""Issue 30, item 1: Hugging Face `transformers` models under every strategy (tiny configs, no downloads).

For GPT-2 (tied head), Llama (untied), Qwen2 (tied) and BERT (tied MLM head, a bias tied by
`p.data = ...`): the initial weights under FSDP built from a factory, FSDP built whole and DDP equal one
process's `torch.manual_seed(0); Model(cfg)` bit for bit (same init code, same generator: equal by
construction), tied parameters stay one parameter in one FSDP unit, a few steps of token-weighted
training land where one process lands, `s.export` writes a directory `from_pretrained` loads, and
`ddpkit verify --strategy fsdp` passes on GPT-2.
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

pytestmark = pytest.mark.numerics  # .ci/run runs these again under ATEN_CPU_CAPABILITY=default


@pytest.mark.parametrize("kind", ["gpt2", "llama", "qwen2", "bert"])
def test_initial_weights_are_one_process_weights_under_every_build(pool2, kind: str) -> None:
    results = pool2.run(hf_ranks.initial_all, kind)
    tied = hf_ranks._tied_names(kind)
    for rank, builds in enumerate(results):
        for build, r in builds.items():
            assert r["differ"] == [], (
                f"rank {rank}, {kind} {build}: {r['differ'][:5]} differ from one process"
            )
            assert r["compared"] > 10
            assert r["tied"] == tied, f"{kind} {build}: the tie came apart"
            assert abs(r["loss"] - builds["ddp-factory"]["loss"]) < 1e-5  # the same forward on each build
        units = builds["fsdp-factory"]["units"]
        assert len(units) >= 3 and units == builds["fsdp-whole"]["units"], (
            units
        )  # blocks sharded on their own
        for a, b in tied:  # both owners of a tied weight in the one unit that holds them (here the root)
            owners = {a.rsplit(".", 1)[0], b.rsplit(".", 1)[0]}
            assert not any(o == u or o.startswith(f"{u}.") for o in owners for u in units if u), units
    losses = [builds["fsdp-factory"]["loss"] for builds in results]
    assert all(abs(loss - torch.log(torch.tensor(96.0)).item()) < 0.2 for loss in losses), losses  # ~ln(V)


def test_a_vits_trunc_normal_init_is_one_process_weights_under_the_shard_by_shard_build(pool2) -> None:
    """ViT's `_init_weights` draws its class token and position embeddings with transformers' captured
    `trunc_normal_` (which returns early on meta): under FSDP's factory build they must still be one
    process's values, bit for bit (same init code, same generator)."""
    for rank, r in enumerate(pool2.run(hf_ranks.initial_fsdp_factory, "vit")):
        assert r["differ"] == [], f"rank {rank}: {r['differ'][:5]} differ from one process"
    one = r["one"]
    std = hf_ranks.config("vit").initializer_range
    for name in ("vit.embeddings.cls_token", "vit.embeddings.position_embeddings"):
        drawn = one[name]  # drawn by trunc_normal_(std=0.02) in one process: small, not torch.randn's
        assert 0 < drawn.std() < 2 * std and drawn.abs().max() < 5 * std, name


def test_gpt2_factory_without_ddpkit_hf_init_would_differ() -> None:
    """The bug of issue 30, shown on one process: HF skips `_init_weights` on meta, and wte's std is 1."""
    with torch.device("meta"):
        model = hf_ranks.factory("gpt2")()
    assert not getattr(model.transformer.wte, "_is_hf_initialized", False)  # post_init skipped it


@pytest.mark.parametrize(
    ("kind", "strategy", "whole"),
    [("gpt2", "fsdp", False), ("llama-tied", "fsdp", True), ("bert", "ddp", False)],
)
def test_token_weighted_training_matches_one_process_and_exports(
    pool2, tmp_path, kind, strategy, whole
) -> None:
    results = pool2.run(hf_ranks.train, kind, strategy, whole, str(tmp_path / "out"))
    assert all(r["token_weighted"] for r in results)
    one = hf_ranks.train_one_process(kind, world=2)
    start = hf_ranks._state(hf_ranks.one_process(kind))
    got = results[0]["final"]
    assert set(got) == set(one)
    for name in one:
        moved = (one[name] - start[name]).norm()
        dist = (got[name] - one[name]).norm()
        assert dist <= 1e-4 * max(moved, 1e-3) + 1e-6, (
            f"{name}: {dist:.3g} from one process (moved {moved:.3g})"
        )
    assert all(torch.equal(got[n], results[1]["final"][n]) for n in got), "the ranks hold other weights"
    loaded = hf_ranks.model_class(kind).from_pretrained(tmp_path / "out")
    reloaded = dict(loaded.named_parameters())
    for name, value in got.items():
        assert torch.equal(reloaded[name].detach(), value), f"{name} is not what was exported"
    for a, b in hf_ranks._tied_names(kind):
        assert loaded.get_parameter(a) is loaded.get_parameter(b)


def test_size_rule_keeps_a_tied_embedding_with_its_head(pool2) -> None:
    for r in pool2.run(hf_ranks.small_units, "qwen2"):
        assert "model.embed_tokens" not in r["units"] and "model" not in r["units"], r["units"]
        assert len(r["units"]) > 4 and r["tied"] == hf_ranks._tied_names("qwen2")


def test_tied_modules_split_over_two_units_is_a_clear_error(pool2) -> None:
    for message in pool2.run(hf_ranks.split_tie):
        assert "tied parameters" in message and "lm_head.weight" in message and "blocks=None" in message


def test_ddpkit_verify_fsdp_passes_on_gpt2(pool2, monkeypatch, capsys) -> None:
    from ddpkit.verify import cli, verify

    monkeypatch.setattr(cli, "verify", lambda spec: verify(spec, runner=pool2.run))
    code = cli.main(
        [
            "--model",
            "hf_ranks:gpt2",
            "--batches",
            "hf_ranks:padded",
            "--loss",
            "hf_ranks:token_sum",
            "--strategy",
            "fsdp",
            "--optimizer",
            "adamw",
            "--steps",
            "3",
            "--batch-size",
            "8",
        ]
    )
    text = capsys.readouterr().out
    assert code == 0 and "verdict: PASS" in text, text[-3000:]
    assert "transformer.wte.weight" in text


def test_a_parameter_hf_init_never_writes_is_refused_not_zeroed() -> None:
    """A custom PreTrainedModel with an `nn.Parameter(torch.empty(...))` its `_init_weights` never writes:
    one process holds whatever memory was there; ddpkit cannot reproduce that and says so (no zeros)."""
    import transformers as tf
    from torch import nn

    from ddpkit import DdpkitError
    from ddpkit.strategy import fsdp_init

    class Tiny(tf.PreTrainedModel):
        config_class = tf.PretrainedConfig

        def __init__(self, config) -> None:
            super().__init__(config)
            self.lin = nn.Linear(4, 4)
            self.scale = nn.Parameter(torch.empty(4))  # no init anywhere
            self.post_init()

        def _init_weights(self, module: nn.Module) -> None:
            if isinstance(module, nn.Linear):
                module.weight.data.normal_(0.0, 0.02)

    with pytest.raises(
        DdpkitError, match=r"Tiny built shard by shard left 1 parameter\(s\) never initialised \(scale\)"
    ):
        fsdp_init.build(lambda: Tiny(tf.PretrainedConfig()), rank=0, world=1)
    fsdp_init.build(hf_ranks.factory("gpt2"), rank=0, world=1)  # a model that initialises everything: built
