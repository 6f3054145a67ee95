"""Tensor-parallel plans without processes: the three forms read into torch's styles, a Hugging Face
model's own plan, the sequence-parallel derivation, the split dimensions each parameter gets, the pieces
a rank keeps, the layout of "tp", and every refusal as one paragraph naming the layer and the fix."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
from tp_ranks import GPT, GPT_PLAN, MLP, MLP_PLAN, llama

from ddpkit.errors import DdpkitError
from ddpkit.parallel.layout import ClusterShape
from ddpkit.strategy import registry, tp_plan
from ddpkit.strategy.tp_init import Piece
from ddpkit.strategy.tp_options import TPOptions

pytestmark = pytest.mark.numerics  # compared with one process: the default-kernel leg runs it too


def _meta(factory):
    with torch.device("meta"):
        return factory()


def test_a_short_mapping_becomes_torch_styles_and_splits_weights_by_rows_or_columns() -> None:
    gpt = _meta(GPT)
    plan = tp_plan.read(gpt, GPT_PLAN, degree=2)
    assert isinstance(plan["blocks.*.attn.q"], ColwiseParallel)
    assert isinstance(plan["blocks.*.attn.o"], RowwiseParallel)
    dims = tp_plan.tp_dims(gpt, plan)
    assert dims["blocks.0.attn.q.weight"] == 0 and dims["blocks.1.mlp.down.weight"] == 1
    assert dims["tok.weight"] is None and dims["norm.weight"] is None
    assert tp_plan.read(_meta(MLP), {"up": ColwiseParallel(), "down": "rowwise"}, degree=2)["up"] is not None
    mlp = tp_plan.tp_dims(_meta(MLP), tp_plan.read(_meta(MLP), MLP_PLAN, degree=2))
    assert (mlp["up.weight"], mlp["up.bias"], mlp["down.weight"], mlp["down.bias"]) == (0, 0, 1, None)


def test_a_hugging_face_model_brings_its_own_plan() -> None:
    model = _meta(lambda: llama(tie_word_embeddings=True))
    plan = tp_plan.read(model, "auto", degree=2)
    assert isinstance(plan["model.layers.*.self_attn.q_proj"], ColwiseParallel)
    assert isinstance(plan["model.layers.*.mlp.down_proj"], RowwiseParallel)
    dims = tp_plan.tp_dims(model, plan)
    assert dims["model.embed_tokens.weight"] == 0 == dims["lm_head.weight"]  # tied: both by rows
    assert tp_plan.describe(model, "auto") == "LlamaForCausalLM's own"


def test_sequence_parallel_keeps_the_stream_a_dtensor_sharded_along_the_sequence() -> None:
    model = _meta(llama)
    plan = tp_plan.read(model, "auto", degree=2, sequence_parallel=True)
    down = plan["model.layers.*.mlp.down_proj"]
    assert down.output_layouts == (Shard(1),) and down.use_local_output is False
    assert plan["model.embed_tokens"].output_layouts == (Shard(1),)
    assert plan["lm_head"].input_layouts == (Shard(1),) and plan["lm_head"].output_layouts == (Replicate(),)
    norms = [n for n, s in plan.items() if isinstance(s, SequenceParallel)]
    assert "model.norm" in norms and "model.layers.0.input_layernorm" in norms
    assert "model.layers.0.self_attn" in plan and "model.layers.1.mlp" in plan  # the inputs gathered


def test_a_rank_keeps_its_tensor_piece_then_fsdps_chunk_of_it() -> None:
    full = torch.arange(48.0).reshape(8, 6)
    assert torch.equal(Piece(1, 2, 0, 1).keep(full, 1), full[:, 3:])
    assert torch.equal(Piece(0, 2, 1, 2).keep(full, 1), full[4:, :3])
    assert torch.equal(Piece(1, 2, 1, 2).keep(full, None), full[4:])


def test_tp_lays_out_tensor_innermost_with_the_data_degrees_over_the_rest() -> None:
    tp = registry.Chosen("tp", TPOptions(tensor=2))
    layout = registry.layout_of(tp, ClusterShape(4, 4))
    assert (layout.replicate, layout.shard, layout.tensor) == (1, 2, 2)
    assert layout.dims == ("replicate", "shard", "tensor")
    assert [layout.coordinate(r, "shard") for r in range(4)] == [0, 0, 1, 1]  # a tensor group: one batch
    hsdp = registry.layout_of(registry.Chosen("tp", TPOptions(tensor=2, replicate=2)), ClusterShape(8, 8))
    assert (hsdp.replicate, hsdp.shard, hsdp.tensor) == (2, 2, 2)
    with pytest.raises(DdpkitError, match="span nodes"):
        registry.layout_of(registry.Chosen("tp", TPOptions(tensor=4)), ClusterShape(4, 2))
    across = TPOptions(tensor=4, tensor_across_nodes=True)
    assert registry.layout_of(registry.Chosen("tp", across), ClusterShape(4, 2)).tensor == 4


def _refusal(model, plan, degree: int = 2) -> str:
    with pytest.raises(DdpkitError) as err:
        tp_plan.read(model, plan, degree=degree)
    return str(err.value)


def test_each_plan_refusal_names_the_layer_and_the_fix() -> None:
    gpt = _meta(GPT)
    text = _refusal(gpt, "auto")
    assert "the GPT has no tensor-parallel plan of its own" in text and "TPOptions(plan=" in text
    text = _refusal(gpt, {"blocks.*.attn.q": "columnwise"})
    assert "'blocks.*.attn.q' the style 'columnwise'" in text and "colwise" in text
    text = _refusal(gpt, {"blocks.*.attn.qq": "colwise"})
    assert "'blocks.*.attn.qq', which matches no module of the GPT" in text and "blocks.*.attn.q" in text
    text = _refusal(gpt, {"blocks.*.norm1": "colwise"})
    assert "splits 'blocks.0.norm1' column-wise, but it is a RMSNorm" in text
    text = _refusal(_meta(lambda: MLP(16, 60)), MLP_PLAN, degree=8)
    assert "'up' has 60 output features, which do not split over the tensor-parallel degree 8" in text
    text = _refusal(_meta(lambda: llama(num_key_value_heads=1)), "auto")
    assert "has 1 heads (config.num_key_value_heads)" in text and "tensor=1" in text
    tied = _meta(lambda: GPT(tied=True))
    text = _refusal(tied, {**GPT_PLAN, "tok": "embedding_colwise", "lm_head": "colwise"})
    assert "the tied parameters" in text and "tie_word_embeddings=False" in text


def test_options_are_checked_when_made() -> None:
    with pytest.raises(DdpkitError, match="random='per-rank'"):
        TPOptions(random="per-rank")
    with pytest.raises(DdpkitError, match="tensor=0"):
        TPOptions(tensor=0)
    assert TPOptions(blocks=None).fsdp().shm is False  # shared memory serves a 1-D mesh only
