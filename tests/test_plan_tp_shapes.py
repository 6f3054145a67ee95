"""`ddpkit plan --memory --strategy tp` over a table of shapes: tensor 2 and 4 with data 1 and 2, shard x
tensor 2 x 2, 2 x 4 and 4 x 2, and HSDP x TP (replicate 2 x shard 2 x tensor 2). The model is the
64-256-128-16 MLP of tests/test_shapes_plan.py with the Megatron pair's plan: its first layer column-wise
(1/T of its rows and bias), its second row-wise (1/T of its columns; its bias whole), the head whole. The
bytes rank 0 holds are computed here from those shapes: the plan divides by the tensor degree first, then
FSDP2 cuts every local tensor along dim 0 into chunks of ceil(rows / S) over the shard degree; AdamW keeps
two fp32 moments per element and a 4-byte step per tensor. At 2 x 2 a plan that swaps the two degrees
gives the right answer; at 2 x 4 and 4 x 2 it does not, nor does one that splits the head or the
row-wise bias."""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterator
from dataclasses import replace

import pytest
from test_shapes_plan import MODEL, SAMPLE, TENSORS, WIDTHS, adamw

from ddpkit.plan import memory, memory_fit
from ddpkit.plan.memory import MemoryJob

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
PLAN = '{"0": "colwise", "2": "rowwise"}'
COLWISE, ROWWISE = 0, 1  # the layers' indices in TENSORS' weights (the head, layer 2, stays whole)


def local(tensor: int) -> list[tuple[int, int]]:
    """(rows, cols) of each tensor on one tensor rank: weights first, then biases (TENSORS' order)."""
    (w0, w1, w2), (b0, b1, b2) = TENSORS[:3], TENSORS[3:]
    return [
        (w0[0] // tensor, w0[1]),  # column-wise: its output features split
        (w1[0], w1[1] // tensor),  # row-wise: its input features split
        w2,
        (b0[0] // tensor, 1),  # the column-wise bias follows its rows
        b1,  # the row-wise bias is added after the reduction: whole
        b2,
    ]


def held(tensor: int, shard: int) -> int:
    """fp32 parameter bytes on rank 0: the plan's split, then FSDP2's chunk of ceil(rows / S) rows."""
    return 4 * sum(math.ceil(rows / shard) * cols for rows, cols in local(tensor))


assert WIDTHS == (64, 256, 128, 16) and held(1, 1) == 4 * 51_600


@pytest.fixture(autouse=True, scope="module")
def _each_step_estimated_once() -> Iterator[None]:
    shared = functools.cache(memory.estimate)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(memory, "estimate", shared)
        patch.setattr(memory_fit, "estimate", shared)
        yield


def _job(world: int, tensor: int, shard: int | None = None) -> MemoryJob:
    return MemoryJob(
        model=MODEL,
        sample=SAMPLE,
        micro_batch=8,
        world=world,
        strategy="tp",
        shard_degree=shard,
        other_degrees=(("tensor", tensor),),
        tp_plan=PLAN,
        device_kind="cpu",
    )


# (world, tensor, shard degree given): the data ranks are world / tensor, sharded unless a shard degree
# leaves replicas (the last row: replicate 2 x shard 2 x tensor 2)
SHAPES = [
    (2, 2, None),  # TP(2)
    (4, 4, None),  # TP(4)
    (4, 2, None),  # FSDP(2) x TP(2): shard x tensor 2 x 2
    (8, 4, None),  # 2 x 4
    (8, 2, None),  # 4 x 2
    (8, 2, 2),  # HSDP(2 x 2) x TP(2)
]


@pytest.mark.parametrize(("world", "tensor", "shard"), SHAPES, ids=[f"{w}-t{t}-s{s}" for w, t, s in SHAPES])
def test_tp_model_state_per_rank_over_every_shape(world: int, tensor: int, shard: int | None) -> None:
    job = _job(world, tensor, shard)
    data = shard or world // tensor
    assert (job.layout.tensor, job.layout.shard) == (tensor, data)
    b = memory.estimate(job)
    mine = held(tensor, data)
    assert b.parameters == mine, (b.parameters, mine)
    assert b.optimizer_state == adamw(mine), b.optimizer_state
    assert b.gradients in (0, mine), b.gradients  # at the peak: none yet, or this rank's (fp32 reduce)
    if shard is not None:  # the replicas of a 2 x 2 shard group hold what FSDP(2) x TP(2) holds
        assert b.as_dict() == memory.estimate(_job(world // 2, tensor)).as_dict()


def test_the_split_layers_activations_divide_by_the_tensor_degree() -> None:
    """At a micro-batch whose activations dominate the step, TP(4) holds less than TP(2) activations:
    the column-wise layer's output (and the ReLU's) is 1/T of its features on each rank."""
    big = [memory.estimate(replace(_job(t, t), micro_batch=256)).activations for t in (2, 4)]
    assert big[1] < big[0]


def _plan(capsys, *args: str) -> tuple[int, dict | str]:
    from ddpkit.plan import cli

    code = cli.main(
        ["--memory", "--model", MODEL, "--sample", SAMPLE, "--device", "cpu", "--device-memory", "1", *args]
    )
    out = capsys.readouterr()
    return code, json.loads(out.out) if code == 0 else out.err


def test_plan_memory_with_a_tensor_degree_names_the_mesh_and_the_bytes(capsys) -> None:
    args = ["--strategy", "tp", "--world", "8", "--tensor-degree", "2", "--tp-plan", PLAN]
    code, plan = _plan(capsys, *args, "--global-batch", "32", "--micro-batch", "8", "--json", "-")
    assert code == 0 and isinstance(plan, dict), plan
    assert plan["job"].startswith("TP 2 x FSDP2 (replicate 1 x shard 4) over 8 rank(s)"), plan["job"]
    assert plan["breakdown"]["parameters"] == held(2, 4)
    assert (plan["data_ranks"], plan["accumulation"]) == (4, 1)  # a tensor group of 2 reads one batch


LLAMA = (
    "hf:llama,hidden_size=64,intermediate_size=128,num_hidden_layers=2,num_attention_heads=4,"
    "num_key_value_heads=2,vocab_size=256,max_position_embeddings=64"
)


def test_a_llama_by_its_own_plan_divides_its_activations_and_sequence_parallel_its_norms() -> None:
    """A Hugging Face Llama split by its own plan ("auto"): at the same micro-batch per rank, FSDP(2) x
    TP(2) holds fewer activations than FSDP(2) (q/k/v, gate/up outputs are 1/2 per rank) and half the
    model state but the norms; sequence parallelism holds fewer still (the norms' inputs 1/2 of the
    sequence)."""
    kw = dict(model=LLAMA, seq_len=64, micro_batch=4, device_kind="cpu")
    fsdp = memory.estimate(MemoryJob(world=2, strategy="fsdp", **kw))
    tp = [
        memory.estimate(
            MemoryJob(world=4, strategy="tp", other_degrees=(("tensor", 2),), sequence_parallel=sp, **kw)
        )
        for sp in (False, True)
    ]
    assert fsdp.activations > tp[0].activations > tp[1].activations, (fsdp, tp)
    assert fsdp.parameters / 2 <= tp[0].parameters < 0.51 * fsdp.parameters  # the norms stay whole


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--strategy", "tp", "--world", "6", "--tensor-degree", "4", "--tp-plan", PLAN], "divide the world"),
        (
            ["--strategy", "tp", "--world", "3", "--tensor-degree", "3", "--tp-plan", PLAN],
            "do not split over",
        ),
        (["--strategy", "tp", "--world", "4", "--tensor-degree", "2"], "no tensor-parallel plan of its own"),
        (["--strategy", "fsdp", "--world", "4", "--tp-plan", PLAN], "--tp-plan"),
        (["--strategy", "fsdp", "--world", "4", "--tensor-degree", "2"], "--tensor-degree 2 is TP's"),
        (["--strategy", "tp", "--world", "4", "--tensor-degree", "2", "--tp-plan", "{0:"], "not valid JSON"),
    ],
    ids=["6-t4", "t3-rows", "no-plan", "fsdp-plan", "fsdp-tensor", "bad-json"],
)
def test_plan_memory_refuses_a_tensor_layout_that_cannot_work_in_one_paragraph(
    capsys, args: list[str], says: str
) -> None:
    code, err = _plan(capsys, *args, "--global-batch", "12", "--json", "-")
    assert code == 2 and isinstance(err, str), err
    assert says in err and "Traceback" not in err, err


def test_when_nothing_fits_twice_the_tensor_degree_is_among_the_alternatives(capsys) -> None:
    args = ["--strategy", "tp", "--world", "4", "--tensor-degree", "2", "--tp-plan", PLAN]
    code, plan = _plan(capsys, *args, "--device-memory", "1e-4", "--global-batch", "8", "--json", "-")
    assert code == 0 and isinstance(plan, dict) and plan["largest_fit"] is None, plan
    tried = [alt["job"] for alt in plan["alternatives"]]
    assert any(job.startswith("TP 4 x FSDP2 (replicate 1 x shard 1) over 4 rank(s)") for job in tried), tried
