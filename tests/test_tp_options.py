"""What each `TPOptions` field changes that the other tensor-parallel tests do not show, in one job of 4
gloo ranks: `shard=1` lays the data ranks out replicated (the mesh replicate 2 x shard 1 x tensor 2, said
at start-up and held by each parameter); the plan given as torch `ParallelStyle`s, as a short mapping and
as "auto" (a Hugging Face model's own) each splits its layers; `blocks` and `min_block_params` choose the
FSDP units; `reshard_after_forward=False` keeps a block's weight gathered (a DTensor on the tensor mesh
alone) between its forward and backward; `cpu_offload` on CPU ranks is said to change nothing;
`random="per-shard"` accepts a dropout the one-process draws refuse, and says so. The layout arithmetic
of `shard` without processes too. Rank functions: tests/tp_ranks.py (the models)."""

from __future__ import annotations

import contextlib
import io
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from tp_ranks import GPT_PLAN, Block, batches, make, weights

import ddpkit
from ddpkit.parallel.layout import ClusterShape
from ddpkit.strategy import registry
from ddpkit.strategy.tp_options import TPOptions

DEGREES = dict(tensor=2, shard=1)  # 4 ranks: replicate 2 x shard 1 x tensor 2
STYLES = {k: ColwiseParallel() if v == "colwise" else RowwiseParallel() for k, v in GPT_PLAN.items()}
Q = "blocks.0.attn.q.weight"


def _units(model: nn.Module) -> list[str]:
    """The FSDP units (fully_shard renames each unit's class FSDP<Class>), the root as ""."""
    return sorted(n for n, m in ddpkit.unwrap(model).named_modules() if type(m).__name__.startswith("FSDP"))


def _param(model: nn.Module, name: str) -> Any:
    return ddpkit.unwrap(model).get_parameter(name)


def _mesh_of(p: Any) -> dict[str, Any]:
    """A parameter's DeviceMesh (dims and sizes) and placements, by name."""
    mesh = p.device_mesh
    return {
        "dims": list(mesh.mesh_dim_names or ()),
        "shape": list(mesh.shape),
        "placements": [type(x).__name__ for x in p.placements],
    }


def option_effects() -> dict[str, Any]:
    """Three models in one TP session (the degrees the session's): the GPT by torch styles with its
    Blocks as units, no reshard after forward, CPU offload and per-shard draws of an attention dropout;
    the GPT by a short mapping with every layer of 1 parameter or more a unit; a Llama by its own plan.
    Their units, the q weight's mesh at rest and between forward and backward, what was said."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), ddpkit.session(seed=0, strategy=TPOptions(**DEGREES)) as s:
        styled = TPOptions(
            **DEGREES,
            plan=STYLES,
            blocks=(Block,),
            reshard_after_forward=False,
            cpu_offload=True,
            random="per-shard",
        )
        chosen = s.model(lambda: make("gpt", attn_dropout=0.1), strategy=styled)
        torch.manual_seed(1)  # s.model seeded each data rank its own stream: the next models alike again
        small = s.model(lambda: make("gpt"), strategy=TPOptions(**DEGREES, plan=GPT_PLAN, min_block_params=1))
        torch.manual_seed(2)
        auto = s.model(lambda: make("llama"), strategy=TPOptions(**DEGREES))  # plan="auto"
        initial = weights(chosen)  # its own plan's pieces of one process's draws (a collective)
        x = batches("gpt", 1)[0]
        at_rest = {"chosen": _mesh_of(_param(chosen, Q)), "small": _mesh_of(_param(small, Q))}
        after_forward = {}
        for name, model in (("chosen", chosen), ("small", small)):
            loss = model(x).float().square().mean()
            after_forward[name] = _mesh_of(_param(model, Q))
            loss.backward()
        q_proj = _mesh_of(_param(auto, "model.layers.0.self_attn.q_proj.weight"))
        return {
            "layout": s.layout.as_dict(),
            "units": {"chosen": _units(chosen), "small": _units(small), "auto": _units(auto)},
            "at_rest": at_rest,
            "after_forward": after_forward,
            "q_proj": q_proj,
            "initial": initial,
            "on_cpu": all(p.device.type == "cpu" for p in chosen.parameters()),
            "said": out.getvalue(),
        }


def test_tp_options_change_the_mesh_the_plan_the_units_the_reshard_and_what_is_said(pool4) -> None:
    results = pool4.run(option_effects, timeout=240)
    got = results[0]
    assert (got["layout"]["replicate"], got["layout"]["shard"], got["layout"]["tensor"]) == (2, 1, 2)
    said = got["said"]
    assert "strategy tp over 4 rank(s), mesh replicate 2 x shard 1 x tensor 2" in said, said
    for r in results:
        rest = r["at_rest"]["chosen"]
        assert rest["dims"] == ["replicate", "shard", "tensor"] and rest["shape"] == [2, 1, 2], rest
        # split on tensor under each plan form: torch styles, a short mapping, the Llama's own plan
        assert rest["placements"][-1] == "Shard" and r["at_rest"]["small"]["placements"][-1] == "Shard"
        assert r["q_proj"]["placements"][-1] == "Shard" and r["q_proj"]["dims"][-1] == "tensor"
        assert r["units"]["chosen"] == ["", "blocks.0", "blocks.1"], r["units"]  # blocks=(Block,)
        small = r["units"]["small"]  # min_block_params=1: each layer with a parameter
        assert {"blocks.0.attn.q", "blocks.1.mlp.down", "tok", "lm_head", "blocks.0.norm1"} <= set(small)
        assert r["units"]["auto"] == [""], r["units"]  # the default 1M: the root only
        # reshard_after_forward=False: gathered over the data ranks (the tensor mesh alone) until backward
        assert r["after_forward"]["chosen"]["dims"] == ["tensor"], r["after_forward"]
        assert r["after_forward"]["small"]["dims"] == ["replicate", "shard", "tensor"], r["after_forward"]
        assert r["on_cpu"]
    with ddpkit.session(seed=0, verbose=False) as s:  # one process: the model's initial weights
        ref = weights(s.model(lambda: make("gpt", attn_dropout=0.1)))
    for name, t in ref.items():  # split by its own plan, not the session's "auto" (which it has not)
        assert torch.equal(got["initial"][name], t), name
    assert "cpu_offload=True changes nothing on CPU ranks" in said, said
    assert said.count("(per-shard: in distribution only)") == 1, said  # the dropout accepted per shard
    assert "LlamaForCausalLM's own" in said


def test_shard_and_replicate_divide_the_data_ranks_as_hsdps() -> None:
    def degrees(options: TPOptions, world: int) -> tuple[int, int, int]:
        layout = registry.layout_of(registry.Chosen("tp", options), ClusterShape(world, world))
        return layout.replicate, layout.shard, layout.tensor

    assert degrees(TPOptions(tensor=2), 8) == (1, 4, 2)  # shard: the data ranks of the node
    assert degrees(TPOptions(tensor=2, shard=1), 8) == (4, 1, 2)  # replicated data parallelism
    assert degrees(TPOptions(tensor=2, shard=2), 8) == (2, 2, 2)
    with pytest.raises(ddpkit.DdpkitError, match="shard"):
        degrees(TPOptions(tensor=2, shard=3), 8)
