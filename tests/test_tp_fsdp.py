"""FSDP(2) x TP(2) on 4 gloo ranks: a Hugging Face Llama from its config (its own plan) trains within
verify's floor of one process with accumulation and active clipping, its checkpoint resumes under DDP(2)
and in one process with the weights it saved, bit for bit, and converts to a Hugging Face folder that
`from_pretrained` loads with the logits of those weights. Rank functions: tests/tp_ranks.py."""

from __future__ import annotations

import functools

import pytest
import torch
from tp_ranks import batches, excess, llama_config, one_process, resumed, train

from ddpkit.checkpoint import convert
from ddpkit.strategy.tp_options import TPOptions

pytestmark = pytest.mark.numerics  # compared with one process: the default-kernel leg runs it too

STEPS, ACCUMULATION = 3, 2


def test_llama_under_fsdp2_x_tp2_trains_resumes_elsewhere_and_converts(pool4, pool2, tmp_path) -> None:
    root = str(tmp_path / "ckpt")
    options = TPOptions(tensor=2, min_block_params=1)  # plan="auto": LlamaForCausalLM's own
    run = functools.partial(train, steps=STEPS, accumulation=ACCUMULATION, save=root)
    ranks = pool4.run(run, "llama", options, timeout=240)
    got = ranks[0]
    assert (got["layout"]["replicate"], got["layout"]["shard"], got["layout"]["tensor"]) == (1, 2, 2)
    assert "mesh replicate 1 x shard 2 x tensor 2" in got["printed"]  # the start-up line names the mesh
    assert "LlamaForCausalLM's own" in got["printed"]

    kw = dict(steps=STEPS, accumulation=ACCUMULATION)
    ref = one_process("llama", **kw)
    variants = [one_process("llama", variant=v, **kw)["states"] for v in ("permuted", "features")]
    for name, a in ref["states"][0].items():  # one process's initial weights, built piece by piece
        assert torch.equal(a, got["states"][0][name]), name
    used, where = excess(ref["states"], got["states"], variants)
    assert used <= 1.0, f"{used:.2f} x verify's tolerance at {where}"
    assert got["norms"] == pytest.approx(ref["norms"], rel=1e-5) and min(ref["norms"]) > 0.5  # clip active

    saved = got["states"][-1]
    ddp = pool2.run(resumed, "llama", "ddp", root, timeout=120)[0]
    single = resumed("llama", None, root)
    for name, t in saved.items():  # the saved weights, whole, at another layout
        assert torch.equal(ddp["loaded"][name], t) and torch.equal(single["loaded"][name], t), name
    used, where = excess([single["loaded"], single["after"]], [ddp["loaded"], ddp["after"]], [])
    assert used <= 1.0, f"the resumed step under DDP(2): {used:.2f} x tolerance at {where}"

    config = tmp_path / "config"
    llama_config().save_pretrained(config)
    folder, count = convert.to_hf(root, tmp_path / "hf", config=config)
    assert count == len(saved)
    from transformers import LlamaForCausalLM

    loaded = LlamaForCausalLM.from_pretrained(folder).eval()
    plain = LlamaForCausalLM(llama_config()).eval()
    plain.load_state_dict(saved, strict=True)
    ids = batches("llama", 1)[0]
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, plain(input_ids=ids).logits)


def test_hsdp_2x2_x_tp2_on_8_ranks_trains_the_gpt_of_one_process() -> None:
    """The 3-D mesh: replicate 2 x shard 2 x tensor 2 on 8 gloo ranks (a pool of its own, closed here)."""
    from rankpool import RankPool
    from tp_ranks import GPT_PLAN

    options = TPOptions(tensor=2, replicate=2, plan=GPT_PLAN, min_block_params=1)
    pool = RankPool(8)
    try:
        ranks = pool.run(functools.partial(train, steps=2), "gpt", options, timeout=110)
    finally:
        pool.close()
    got = ranks[0]
    assert (got["layout"]["replicate"], got["layout"]["shard"], got["layout"]["tensor"]) == (2, 2, 2)
    ref = one_process("gpt", steps=2)
    variants = [one_process("gpt", steps=2, variant=v)["states"] for v in ("permuted", "features")]
    used, where = excess(ref["states"], got["states"], variants)
    assert used <= 1.0, f"{used:.2f} x verify's tolerance at {where}"
    assert all(torch.equal(ranks[7]["states"][-1][n], t) for n, t in got["states"][-1].items())
