"""What `s.export` and `ddpkit checkpoint convert` write beside the weights, on every model family the
README names for them, and what a user's `from_pretrained` and `generate()` make of it.

Families and features (README "Hugging Face models": GPT-2, Llama tied and untied, Qwen2, BERT; ViT in
docs/testing.md; LoRA: GPT-2 and Llama in docs/equivalence.md), tiny configs from `hf_ranks.config`,
offline:

- `s.export(dir, model)` of an HF model: every family, under FSDP(2) (streamed shards) and in one
  process (the whole-model writer): the files are those `save_pretrained` writes (config.json the same,
  `architectures` and `dtype` included; generation_config.json for a model that generates, none for
  BERT and ViT), `from_pretrained` loads the weights bit for bit, its forward is the in-memory model's
  and, for the causal LMs, `generate()` gives the in-memory model's greedy tokens.
- `ddpkit checkpoint convert CKPT DIR --config EXPORT`: every family, from a DDP(2) checkpoint (whole
  file) and from an FSDP(2) one (DCP shards), the same checks on the folder it writes; and back
  (`convert EXPORT CKPT`): the checkpoint resumes strictly into a fresh model with the trained forward.
- `s.export(dir, peft_model)` and `merged=True`: GPT-2 and Llama (the LoRA families; BERT and ViT are
  named for no adapter feature), in one process, DDP(2) and FSDP(2) for Llama (its rotary `inv_freq` is a
  buffer no state dict holds: the merged twin built on `meta` must get it), DDP(2) for GPT-2.
"""

from __future__ import annotations

import json
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

import hf_ranks
from fsdp_train import full_params

import ddpkit
from ddpkit.checkpoint import convert
from ddpkit.strategy import FSDPOptions
from ddpkit.verify.calibrate import deviation

pytestmark = pytest.mark.numerics

FAMILIES = ["gpt2", "llama", "llama-tied", "qwen2", "bert", "vit"]
CAUSAL = {"gpt2", "llama", "llama-tied", "qwen2"}
LORA_TARGETS = {"gpt2": ["c_attn"], "llama": ["q_proj", "v_proj"]}
NEW_TOKENS = 4  # greedy tokens compared
FLOOR = 1e-5  # relative norm: a merged forward against the adapted one (rounding of W + BA only)


def inputs(kind: str) -> dict[str, torch.Tensor]:
    """One fixed input row (the same on every rank): pixels for ViT, token ids otherwise."""
    g = torch.Generator().manual_seed(5)
    if kind == "vit":
        return {"pixel_values": torch.randn(1, 3, 8, 8, generator=g)}
    return {"input_ids": torch.randint(3, hf_ranks.VOCAB, (1, 6), generator=g)}


def _output(out) -> torch.Tensor:
    return out.logits.detach().float().cpu()


@torch.no_grad()
def greedy(model, ids: torch.Tensor, steps: int, eos: int | None) -> dict:
    """Greedy decoding by plain forwards (no cache, no generate: what every strategy's model can run, all
    ranks alike); the tokens, and the least gap between the top two logits (so that rounding cannot flip
    a choice the comparison relies on)."""
    tokens, gap = ids, float("inf")
    for _ in range(steps):
        last = model(input_ids=tokens, use_cache=False).logits[:, -1].float()
        top = last.topk(2).values
        gap = min(gap, float(top[0, 0] - top[0, 1]))
        nxt = last.argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, nxt], dim=1)
        if eos is not None and int(nxt) == eos:
            break
    return {"tokens": tokens.cpu(), "gap": gap}


def _strategy(strategy: str) -> object:
    return FSDPOptions(min_block_params=2_000) if strategy == "fsdp" else strategy


# -- rank functions (the pools run them; one process calls them too) ----------------------------------
def export_families(strategy: str, root: str) -> dict:
    """Every family built from its config under `strategy`, exported to `root/<kind>`, then saved to
    `root/ckpt-<kind>` (for convert); its weights, its forward and (causal LMs) its greedy tokens."""
    out = {}
    for kind in FAMILIES:
        with ddpkit.session(seed=0, verbose=False) as s:
            build = hf_ranks.factory(kind)
            model = s.model(build) if strategy == "single" else s.model(build, strategy=_strategy(strategy))
            model.eval()
            with torch.no_grad():
                logits = _output(model(**inputs(kind)))
            ids = inputs(kind).get("input_ids")
            decoded = (
                greedy(model, ids, NEW_TOKENS, hf_ranks.config(kind).eos_token_id) if kind in CAUSAL else None
            )
            s.export(f"{root}/{kind}", model)
            s.save(f"{root}/ckpt-{kind}", model=model, step=1)
            out[kind] = {"weights": full_params(model), "logits": logits, "greedy": decoded}
    return out


def lora_exports(kind: str, strategy: str | None, base: str, root: str) -> dict:
    """A LoRA model over the pretrained `base` (B drawn at random, so the adapters change the forward),
    exported as the adapter directory and merged; its forward, the base's (adapters off), its greedy
    tokens and its gathered adapters."""
    from peft import LoraConfig, get_peft_model

    cls = hf_ranks.model_class(kind)
    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules=LORA_TARGETS[kind], lora_dropout=0.0, init_lora_weights=False
    )
    with ddpkit.session(seed=0, verbose=False) as s:
        build = lambda: get_peft_model(cls.from_pretrained(base), lora)  # noqa: E731
        model = s.model(build) if strategy is None else s.model(build, strategy=_strategy(strategy))
        model.eval()
        ids = inputs(kind)["input_ids"]
        with torch.no_grad():
            logits = _output(model(input_ids=ids))
            with ddpkit.unwrap(model).disable_adapter():
                plain = _output(model(input_ids=ids))
        decoded = greedy(model, ids, NEW_TOKENS, hf_ranks.config(kind).eos_token_id)
        s.export(f"{root}/adapter", model)
        s.export(f"{root}/merged", model, merged=True)
        adapters = {n: t for n, t in full_params(model).items() if "lora_" in n}
        return {"logits": logits, "plain": plain, "greedy": decoded, "adapters": adapters}


# -- checks in the test process -----------------------------------------------------------------------
def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def _reference_files(kind: str, tmp: Path) -> Path:
    """What `save_pretrained` writes for the same model (its own writer: the files ddpkit's must match)."""
    ref = tmp / f"reference-{kind}"
    if not ref.exists():
        hf_ranks.one_process(kind).save_pretrained(ref)
    return ref


def _beside_the_weights(kind: str, folder: Path, tmp: Path) -> None:
    """The files a loader reads beside model.safetensors: those save_pretrained writes, the same JSON."""
    ref = _reference_files(kind, tmp)
    names = {p.name for p in folder.iterdir()}
    want = {p.name for p in ref.iterdir()}
    assert names == want, f"{kind}: {sorted(names)} written, save_pretrained writes {sorted(want)}"
    assert ("generation_config.json" in names) == (kind in CAUSAL), sorted(names)
    for name in sorted(want - {"model.safetensors"}):
        got, expected = _json(folder / name), _json(ref / name)
        assert got == expected, f"{kind} {name}: " + str(
            {
                k: (got.get(k), expected.get(k))
                for k in set(got) | set(expected)
                if got.get(k) != expected.get(k)
            }
        )


def _loads_and_runs(kind: str, folder: Path, trained: dict, *, bitwise: bool = True) -> None:
    """`from_pretrained(folder)`: the trained weights, the trained forward, and for a causal LM the user's
    `generate()` gives the in-memory model's greedy tokens."""
    loaded = hf_ranks.model_class(kind).from_pretrained(folder).eval()
    state = dict(loaded.named_parameters())
    assert set(state) == set(trained["weights"]), sorted(set(state) ^ set(trained["weights"]))
    if bitwise:  # the same tensors written and read back
        differ = [n for n, w in trained["weights"].items() if not torch.equal(state[n].detach(), w)]
        assert differ == [], f"{kind}: {differ[:4]} are not the trained weights"
    for a, b in [] if kind == "vit" else hf_ranks._tied_names(kind):  # ViT ties nothing
        assert loaded.get_parameter(a) is loaded.get_parameter(b), f"{kind}: {a} and {b} came untied"
    with torch.no_grad():
        dev = deviation(trained["logits"], _output(loaded(**inputs(kind))))
    assert dev.rel_norm < FLOOR, f"{kind}: the loaded forward is {dev} from the in-memory one"
    if kind in CAUSAL:
        _generates_alike(loaded, kind, trained["greedy"], max_new_tokens=NEW_TOKENS)


def _generates_alike(loaded, kind: str, greedy_ref: dict, **options) -> None:
    assert greedy_ref["gap"] > 1e-4, f"{kind}: a near tie in the reference ({greedy_ref['gap']:.2g})"
    ids = inputs(kind)["input_ids"]
    with torch.no_grad():
        got = loaded.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, **options)
    assert torch.equal(got, greedy_ref["tokens"]), f"{kind}: generate() {got} against {greedy_ref['tokens']}"


@pytest.fixture(scope="module")
def fsdp_families(pool2, tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("fsdp")
    return root, pool2.run(export_families, "fsdp", str(root), timeout=240)[0]


@pytest.fixture(scope="module")
def ddp_families(pool2, tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("ddp")
    return root, pool2.run(export_families, "ddp", str(root), timeout=240)[0]


@pytest.mark.parametrize("kind", FAMILIES)
def test_fsdp_export_of_every_family_loads_and_generates(fsdp_families, tmp_path_factory, kind) -> None:
    root, trained = fsdp_families
    _beside_the_weights(kind, root / kind, tmp_path_factory.getbasetemp())
    _loads_and_runs(kind, root / kind, trained[kind])


@pytest.mark.timeout(240)
def test_one_process_export_of_every_family_loads_and_generates(tmp_path) -> None:
    """The whole-model writer (one process; DDP writes through it too)."""
    trained = export_families("single", str(tmp_path))
    for kind in FAMILIES:
        _beside_the_weights(kind, tmp_path / kind, tmp_path)
        _loads_and_runs(kind, tmp_path / kind, trained[kind])


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("kind", FAMILIES)
def test_converted_checkpoint_of_every_family_loads_and_generates(
    request, tmp_path, tmp_path_factory, kind, strategy
) -> None:
    """`ddpkit checkpoint convert CKPT DIR --config EXPORT` (the CLI's call, in this process) from DDP's
    whole file and FSDP's DCP shards: the folder holds the export's config files and loads as the
    trained model."""
    root, trained = request.getfixturevalue(f"{strategy}_families")
    out = tmp_path / "hf"
    convert.to_hf(root / f"ckpt-{kind}", out, config=root / kind)
    _beside_the_weights(kind, out, tmp_path_factory.getbasetemp())
    _loads_and_runs(kind, out, trained[kind])


@pytest.mark.parametrize("kind", FAMILIES)
def test_an_export_converted_back_resumes_as_the_trained_model(ddp_families, tmp_path, kind) -> None:
    """`ddpkit checkpoint convert EXPORT CKPT` (the way back, in this process): the checkpoint it writes
    loads strictly into a fresh model in one process, whose forward is the trained one."""
    root, trained = ddp_families
    back = convert.from_weights(root / kind, tmp_path / "back", step=5)
    with ddpkit.session(env={}, seed=1, verbose=False) as s:
        fresh = s.model(hf_ranks.factory(kind))
        assert s.load(back.parent, model=fresh, step=0) == {"step": 5}
        fresh.eval()
        with torch.no_grad():
            dev = deviation(trained[kind]["logits"], _output(fresh(**inputs(kind))))
    assert dev.rel_norm < FLOOR, f"{kind}: the resumed forward is {dev} from the trained one"


# -- LoRA -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, str]:
    """Pretrained bases written by save_pretrained, each with a generation config of its own (3 new
    tokens, greedy): the merged export must keep the user's, not the defaults of the config."""
    root = tmp_path_factory.mktemp("lora-bases")
    for kind in LORA_TARGETS:
        model = hf_ranks.one_process(kind, seed=123)
        model.generation_config.max_new_tokens = 3
        model.generation_config.do_sample = False
        model.save_pretrained(root / kind)
    return {kind: str(root / kind) for kind in LORA_TARGETS}


LORA_RUNS = [("llama", None), ("llama", "ddp"), ("llama", "fsdp"), ("gpt2", "ddp")]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("kind", "strategy"), LORA_RUNS, ids=[f"{k}-{s or 'one'}" for k, s in LORA_RUNS])
def test_lora_adapter_and_merged_exports_load_and_generate(pool2, bases, tmp_path, kind, strategy) -> None:
    """The merged export of a Llama-style model failed on its rotary `inv_freq` (a non-persistent buffer
    left on `meta`); both directories now load: the adapters bit for bit, the merged forward within the
    floor of the adapted in-memory model's, and a user's plain `generate()` (the base's generation
    config: 3 greedy tokens) gives the in-memory model's tokens from either."""
    from peft import PeftConfig, PeftModel

    if strategy is None:
        result = lora_exports(kind, None, bases[kind], str(tmp_path))
    else:
        result = pool2.run(lora_exports, kind, strategy, bases[kind], str(tmp_path), timeout=200)[0]
    cls = hf_ranks.model_class(kind)
    gap = deviation(result["plain"], result["logits"]).rel_norm
    assert gap > 100 * FLOOR, f"the adapters barely change the forward ({gap:.2g}): the test proves nothing"

    merged_dir = tmp_path / "merged"
    assert {p.name for p in merged_dir.iterdir()} == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
    }
    assert _json(merged_dir / "config.json")["architectures"] == [cls.__name__]
    generation = _json(merged_dir / "generation_config.json")
    assert generation["max_new_tokens"] == 3 and generation["do_sample"] is False, generation
    merged = cls.from_pretrained(merged_dir).eval()
    assert not any("lora" in k for k in merged.state_dict())
    with torch.no_grad():
        dev = deviation(result["logits"], _output(merged(**inputs(kind))))
    assert dev.rel_norm < FLOOR, f"the merged model's forward is {dev} from the adapted model's"
    reference = {"tokens": result["greedy"]["tokens"][:, : inputs(kind)["input_ids"].shape[1] + 3]}
    _generates_alike(merged, kind, {**result["greedy"], **reference})

    adapter_dir = tmp_path / "adapter"
    config = PeftConfig.from_pretrained(str(adapter_dir))
    assert (config.r, config.lora_alpha, sorted(config.target_modules)) == (4, 8, sorted(LORA_TARGETS[kind]))
    loaded = PeftModel.from_pretrained(cls.from_pretrained(bases[kind]), str(adapter_dir)).eval()
    got = {n: p.detach() for n, p in loaded.named_parameters() if "lora_" in n}
    assert set(got) == set(result["adapters"]) and got
    assert all(torch.equal(got[n], result["adapters"][n]) for n in got), "the exported adapters differ"
    _generates_alike(loaded, kind, {**result["greedy"], **reference})
