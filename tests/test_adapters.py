"""LoRA adapters (`peft`) under ddpkit: a PEFT model goes in like any module, starts as one process's
bit for bit, trains to one process's within the calibrated noise floor (DDP and FSDP on 2 ranks), keeps
its frozen base untouched, without gradients or optimizer state; checkpoints hold the adapters and their
optimizer state only and resume exactly; `s.export` writes the adapter directory `PeftModel` loads and,
on request, the merged model `from_pretrained` loads, whose forward is the adapted model's.

Real peft and transformers, tiny configs, the pretrained base written by the test (offline)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if os.environ.get("CI"):
    import peft  # noqa: F401  (in CI the test extra installs it: a missing one fails, never skips)
    import transformers  # noqa: F401
else:
    pytest.importorskip("transformers")
    pytest.importorskip("peft")

import adapter_ranks
import hf_ranks

from ddpkit.verify.calibrate import deviation, limit
from ddpkit.verify.spec import Tolerance


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("bases")
    for kind in ("gpt2", "llama"):
        hf_ranks.pretrained(kind, str(root / kind))
    return {kind: str(root / kind) for kind in ("gpt2", "llama")}


_ONE_PROCESS: dict[tuple, tuple[list, list]] = {}


def _one_process_runs(kind: str, base: str, how: str, world: int, rescaled: bool) -> tuple[list, list]:
    """One process's run and its permuted variant (the floor), once per module for each set-up: several
    tests compare against the same one (plain torch and peft, no ddpkit code: a mutant cannot reach it)."""
    key = (kind, base, how, world, rescaled)
    if key not in _ONE_PROCESS:
        _ONE_PROCESS[key] = (
            adapter_ranks.train_one_process(kind, base, how, world, rescaled=rescaled),
            adapter_ranks.train_one_process(kind, base, how, world, permuted=True, rescaled=rescaled),
        )
    return _ONE_PROCESS[key]


def _within_floor(
    got: dict[str, torch.Tensor], kind: str, base: str, how: str, world: int, rescaled: bool = False
) -> None:
    """`got` (the distributed run's final adapters) against one process's, per tensor, within the
    tolerance verify uses: 10x the floor (one process against itself with its rows permuted), 8 eps,
    or 1% of the last step's update. `rescaled`: one process back-propagating the token sum over a power
    of two, as ddpkit's token weighting does (`adapter_ranks.train_one_process`)."""
    ref, variant = _one_process_runs(kind, base, how, world, rescaled)
    assert set(got) == set(ref[-1]) and got
    for name, a in ref[-1].items():
        floor = (deviation(a, variant[-1][name]).rel_norm, deviation(a, variant[-1][name]).max_abs)
        tol = limit(Tolerance(), a, floor, deviation(ref[-2][name], a))
        dev = deviation(a, got[name])
        assert tol.excess(dev) <= 1, f"{name}: {dev} beyond {tol}"
        moved = deviation(ref[0][name], a).rel_norm
        assert moved > 1e-3, f"{name} barely trained ({moved:.3g}): the comparison would prove nothing"


@pytest.mark.numerics
@pytest.mark.parametrize("how", ["pretrained", "config"])
def test_fsdp_adapters_start_as_one_process_bit_for_bit(pool2, base, how) -> None:
    """LoRA's A matrices are drawn after the base is built: the shard-by-shard build must consume the
    generator as one process does around `from_pretrained` (else A starts from other values)."""
    one = adapter_ranks.one_process("gpt2", base["gpt2"], how)
    want = {n: p.detach() for n, p in one.named_parameters() if p.requires_grad}
    for r in pool2.run(adapter_ranks.train, "gpt2", "fsdp", how, base["gpt2"], 0):
        assert set(r["initial"]) == set(want) and any("lora_A" in n for n in want)
        differ = [n for n in want if not torch.equal(r["initial"][n], want[n])]
        assert differ == [], f"{differ} start from other values than one process's"


@pytest.mark.numerics
@pytest.mark.parametrize(
    ("kind", "strategy", "how"),
    [
        ("gpt2", "ddp", "pretrained"),
        ("gpt2", "fsdp", "pretrained"),
        ("llama", "fsdp", "config"),
        ("llama", "fsdp", "pretrained"),
        ("llama", "ddp", "config"),
    ],
)
def test_lora_training_matches_one_process_within_the_floor(pool2, base, kind, strategy, how) -> None:
    results = pool2.run(adapter_ranks.train, kind, strategy, how, base[kind])
    for r in results:
        assert r["frozen_moved"] == [] and r["frozen_grads"] == [], "the frozen base changed or got gradients"
        assert r["with_state"] == sorted(r["final"]), "optimizer state for other than the adapters"
    assert all(torch.equal(results[0]["final"][n], results[1]["final"][n]) for n in results[0]["final"])
    _within_floor(results[0]["final"], kind, base[kind], how, world=2)


@pytest.mark.numerics
@pytest.mark.parametrize(("strategy", "how"), [("ddp", "bf16-cast"), ("fsdp", "bf16")])
def test_bf16_base_with_fp32_adapters_trains_as_one_process(pool2, base, strategy, how) -> None:
    """The base stored in bf16, the adapters in fp32: "bf16", peft's default (the base cast before
    get_peft_model; built shard by shard, the adapters must still be rounded through bf16 as one
    process's are); "bf16-cast", the whole PEFT model cast to bf16, whose adapters s.model keeps in fp32.
    The adapters, their gradients' reduction and AdamW state stay fp32, the bf16 base untouched, the
    loss over the batches trained on falls (4.565 to 4.557 on one process: random tokens), and the adapters end within the floor of one process with the same bf16 base. The
    reference back-propagates at ddpkit's loss scale (a power of two): in a bf16 backward another scale
    rounds differently, and one process at the plain 1/tokens ends 2-5 % away (not a distributed effect)."""
    results = pool2.run(adapter_ranks.train, "gpt2", strategy, how, base["gpt2"], 4, None, "auto", None, True)
    for r in results:
        assert r["dtypes"] == [(False, "torch.bfloat16"), (True, "torch.float32"), ("state", "torch.float32")]
        assert r["frozen_moved"] == [] and r["frozen_grads"] == []
        assert r["with_state"] == sorted(r["final"])
    assert ("kept the PEFT model's 4 trainable tensors in fp32" in results[0]["printed"]) == (
        how == "bf16-cast"
    )
    before, after = results[0]["losses"]  # over the 8 global micro-batches trained on (random tokens)
    assert after < before - 0.004, f"the loss did not fall: {before} -> {after}"
    _within_floor(results[0]["final"], "gpt2", base["gpt2"], how, world=2, rescaled=True)


@pytest.mark.numerics
def test_hsdp_2x2_trains_the_adapters_of_one_process(pool4, base) -> None:
    """HSDP, replicate 2 x shard 2 on 4 ranks (the degrees given to the session): the frozen base
    untouched, without gradients or optimizer state, the adapters the same bit for bit on all 4 ranks
    (both replicas) and within the floor of one process on the 4-rank global batch."""
    results = pool4.run(adapter_ranks.train, "gpt2", "hsdp", "config", base["gpt2"])
    assert "mesh replicate 2 x shard 2" in results[0]["printed"], results[0]["printed"][-2000:]
    for r in results:
        assert r["frozen_moved"] == [] and r["frozen_grads"] == [], "the frozen base changed or got gradients"
        assert r["with_state"] == sorted(r["final"]), "optimizer state for other than the adapters"
        assert all(torch.equal(r["final"][n], results[0]["final"][n]) for n in r["final"]), "ranks differ"
    _within_floor(results[0]["final"], "gpt2", base["gpt2"], "config", world=4)


@pytest.mark.numerics
def test_sharded_step_leaves_the_frozen_base_alone(pool2, base) -> None:
    """The optimizer given every parameter (frozen base included) with the sharded step: only the
    trainable elements are split and published (not the base at every step), and training is right."""
    results = pool2.run(adapter_ranks.train, "gpt2", "ddp", "pretrained", base["gpt2"], 4, None, "gradients")
    one = adapter_ranks.one_process("gpt2", base["gpt2"], "pretrained")
    adapters = sum(p.numel() for p in one.parameters() if p.requires_grad)
    assert f"AdamW, {adapters} trainable elements" in results[0]["printed"], results[0]["printed"][-2000:]
    for r in results:
        assert r["frozen_moved"] == [] and r["frozen_grads"] == []
    _within_floor(results[0]["final"], "gpt2", base["gpt2"], "pretrained", world=2)


RECOMPUTE = {"activation_checkpointing": "auto"}  # GPT2Block, found through the PeftModel


@pytest.mark.parametrize(
    ("strategy", "options"),
    [("ddp", None), ("fsdp", None), ("fsdp", RECOMPUTE)],
    ids=["ddp", "fsdp", "fsdp-recompute"],
)
def test_checkpoint_holds_adapters_only_and_resumes_bitwise(pool2, base, tmp_path, strategy, options) -> None:
    """With activation checkpointing too: its wrappers are in the parameters' names, not the state's."""
    results = pool2.run(
        adapter_ranks.save_and_resume, "gpt2", strategy, base["gpt2"], str(tmp_path / "ckpt"), options
    )
    for r in results:
        differ = [n for n in r["straight"] if not torch.equal(r["straight"][n], r["resumed"][n])]
        assert differ == [], f"resumed adapters differ from the straight run: {differ}"
    saved = Path(results[0]["saved"])
    trained = set(results[0]["straight"])
    names: dict[str, int] = {}  # every tensor the checkpoint holds -> elements
    from safetensors import safe_open

    for f in saved.rglob("*.safetensors"):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():  # noqa: SIM118 (safe_open is not iterable)
                names[k] = int(torch.Size(st.get_slice(k).get_shape()).numel())
    if (saved / "dcp").is_dir():
        from torch.distributed.checkpoint import FileSystemReader

        for k, v in FileSystemReader(str(saved / "dcp")).read_metadata().state_dict_metadata.items():
            if hasattr(v, "size"):
                names[k] = int(v.size.numel())
    model_keys = [k for k in names if "transformer." in k and ".state." not in k and "optimizer" not in k]
    assert model_keys and all(any(k.endswith(t) for t in trained) for k in model_keys), model_keys
    one = adapter_ranks.one_process("gpt2", base["gpt2"], "config")
    frozen = sum(p.numel() for p in one.parameters() if not p.requires_grad)
    adapters = sum(p.numel() for p in one.parameters() if p.requires_grad)
    held = sum(n for k, n in names.items() if "transformer." in k)
    assert held <= 3 * adapters + 16 < frozen, (
        f"{held} elements saved for {adapters} adapter elements"
    )  # + steps


@pytest.mark.numerics
def test_export_adapter_directory_and_merged_model(pool2, base, tmp_path) -> None:
    """Under FSDP with activation checkpointing (each GPT2Block recomputed): the parameters' names carry
    the wrapper's segment, the exported files must not (else `PeftModel` loads none of the adapters, with
    a warning). The export without checkpointing: the compiled DDP test below."""
    from peft import PeftModel

    out = tmp_path / "out"
    results = pool2.run(
        adapter_ranks.train, "gpt2", "fsdp", "config", base["gpt2"], 3, str(out), "auto", RECOMPUTE
    )
    assert "activation checkpointing: 2 GPT2Block" in results[0]["printed"], results[0]["printed"][-2000:]
    assert (out / "adapter" / "adapter_config.json").is_file()
    assert not (out / "adapter" / "model.safetensors").exists()
    cls = hf_ranks.model_class("gpt2")
    loaded = PeftModel.from_pretrained(cls.from_pretrained(base["gpt2"]), str(out / "adapter"))
    got = {n: p.detach() for n, p in loaded.named_parameters() if "lora_" in n}
    assert set(got) == set(results[0]["final"])
    assert all(torch.equal(got[n], results[0]["final"][n]) for n in got), "the exported adapters differ"
    ids = hf_ranks.padded(99, rows=2)["input_ids"]
    with torch.no_grad():
        adapted = loaded(input_ids=ids).logits
        merged = cls.from_pretrained(out / "merged")(input_ids=ids).logits
    assert torch.allclose(adapted, results[0]["logits"], rtol=0, atol=1e-5)
    dev = deviation(adapted, merged)
    assert dev.rel_norm < 1e-5, f"the merged model's forward is {dev} from the adapted model's"
    assert not any("lora" in k for k in cls.from_pretrained(out / "merged").state_dict())


@pytest.mark.numerics
@pytest.mark.parametrize(
    ("strategy", "options", "note"), [("ddp", {"compile": {"backend": "aot_eager"}}, "")], ids=["ddp-compile"]
)
def test_activation_checkpointing_and_compile_on_a_peft_model(
    pool2, base, tmp_path, strategy, options, note
) -> None:
    """A PEFT model recomputed per block (FSDP) or compiled (DDP; Dynamo and AOTAutograd through peft's
    LoRA layers, without Inductor's C++): trains to one process's within the floor, and exports the
    adapter directory `PeftModel` loads (the wrappers' names kept out of it)."""
    from peft import PeftModel

    out = tmp_path / "out"
    results = pool2.run(
        adapter_ranks.train, "gpt2", strategy, "config", base["gpt2"], 4, str(out), "auto", options
    )
    assert note in results[0]["printed"], results[0]["printed"][-2000:]
    assert ("compile" not in options) or results[0]["graphs"] > 0, "nothing was compiled"
    for r in results:
        assert r["frozen_moved"] == [] and r["frozen_grads"] == []
        assert r["with_state"] == sorted(r["final"]) and r["final"]
    _within_floor(results[0]["final"], "gpt2", base["gpt2"], "config", world=2)
    loaded = PeftModel.from_pretrained(
        hf_ranks.model_class("gpt2").from_pretrained(base["gpt2"]), str(out / "adapter")
    )
    got = {n: p.detach() for n, p in loaded.named_parameters() if "lora_" in n}
    assert set(got) == set(results[0]["final"])
    assert all(torch.equal(got[n], results[0]["final"][n]) for n in got), "the exported adapters differ"


def test_checkpoint_of_other_adapters_is_a_clear_error(tmp_path, base) -> None:
    import ddpkit

    model = adapter_ranks.one_process("gpt2", base["gpt2"], "config")
    from ddpkit.strategy import base as strategy_base

    with pytest.raises(ddpkit.DdpkitError, match=r"lacks 4 of the adapter model's trainable tensors"):
        strategy_base.Strategy().load_full_state(model, {}, strict=True)


@pytest.mark.numerics
@pytest.mark.parametrize(
    ("strategy", "loss"), [("fsdp", "hf_ranks:token_sum"), ("ddp", "adapter_ranks:tuple_token_sum")]
)
def test_ddpkit_verify_passes_on_a_peft_model_with_its_default_floor(
    pool2, monkeypatch, capsys, strategy, loss
) -> None:
    """Default options (the 'permuted' and 'chunked' floor): a ModelOutput, and a tuple holding the
    key-value cache, are both read by the chunked variant."""
    from ddpkit.verify import cli, verify

    monkeypatch.setattr(cli, "verify", lambda spec: verify(spec, runner=pool2.run))
    code = cli.main(
        [
            "--model",
            "adapter_ranks:gpt2_lora",
            "--batches",
            "hf_ranks:padded",
            "--loss",
            loss,
            "--strategy",
            strategy,
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
    assert "lora_A" in text


def test_lint_names_find_unused_parameters_set_for_a_frozen_base() -> None:
    from ddpkit.lint import lint_source

    def script(flag: str) -> str:
        return (
            "import ddpkit, torch\n"
            "from peft import LoraConfig, get_peft_model\n"
            "from transformers import AutoModelForCausalLM\n"
            "with ddpkit.session() as s:\n"
            "    build = lambda: get_peft_model(AutoModelForCausalLM.from_pretrained('base'), LoraConfig())\n"
            f"    model = s.model(build{flag})\n"
        )

    findings = [
        f for f in lint_source(script(", find_unused_parameters=True"), "train.py") if f.code == "DDP012"
    ]
    assert len(findings) == 1 and "frozen base" in findings[0].message, findings
    assert [f for f in lint_source(script(""), "train.py") if f.code == "DDP012"] == []


def test_an_optimizer_over_the_frozen_base_only_stops_the_first_step(base) -> None:
    """The optimizer built over the base before get_peft_model froze it: every parameter it holds is
    frozen, the adapters are in no optimizer, and each step would silently change nothing. One process
    (the check is local, every rank raises alike); AdamW over model.parameters() (a mix) steps normally."""
    import ddpkit

    cls = hf_ranks.model_class("gpt2")
    ids = hf_ranks.padded(0, rows=2)
    with ddpkit.session(seed=0, verbose=False, log_to=None) as s:
        inner = cls(hf_ranks.config("gpt2"))
        early = torch.optim.AdamW(inner.parameters(), lr=1e-2)  # before get_peft_model: the base only
        model = s.model(lambda: adapter_ranks.get_peft(inner, "gpt2"))
        with s.accumulate(model):
            s.backward(hf_ranks.token_sum(model, ids)[0])
        with pytest.raises(ddpkit.DdpkitError, match=r"none of them requires a gradient: all are frozen"):
            s.step(early)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        before = adapter_ranks.trainable(model)
        s.step(opt)  # the same micro-batch's gradients, now stepped
        after = adapter_ranks.trainable(model)
    assert any(not torch.equal(before[n], after[n]) for n in before), "the adapters did not train"


@pytest.mark.numerics
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_adapter_checkpoint_resumes_in_one_process_within_the_floor(pool2, base, tmp_path, strategy) -> None:
    """Saved by 2 ranks after 2 steps (DDP: whole adapters; FSDP: sharded adapters and AdamW state),
    resumed by ONE process (another world size; this process, no pool) for the other 2 steps on the same
    global batches: the adapters end within the floor of one process's 4 uninterrupted steps. What the
    checkpoint holds (adapters only): the bitwise-resume test above."""
    root = str(tmp_path / "ckpt")
    saved = pool2.run(adapter_ranks.save_after_two_steps, "gpt2", strategy, base["gpt2"], root)
    assert saved[0] is not None
    resumed = adapter_ranks.resume_in_one_process("gpt2", base["gpt2"], root, world=2)
    _within_floor(resumed, "gpt2", base["gpt2"], "config", world=2)


@pytest.mark.numerics
def test_one_process_adapter_checkpoint_resumes_under_fsdp2_within_the_floor(pool2, base, tmp_path) -> None:
    """The other way: one process (this one) saves after 2 steps on the 2-rank global batch, FSDP(2)
    loads it (whole adapters and AdamW state cut into shards) and runs the other 2 steps."""
    root = str(tmp_path / "ckpt")
    assert adapter_ranks.save_after_two_steps("gpt2", "ddp", base["gpt2"], root, world=2) is not None
    resumed = pool2.run(adapter_ranks.resume_on_ranks, "gpt2", "fsdp", base["gpt2"], root)
    assert all(torch.equal(resumed[0][n], resumed[1][n]) for n in resumed[0])
    _within_floor(resumed[0], "gpt2", base["gpt2"], "config", world=2)
