"""The plans over a table of shapes, not only 2 x 2: `ddpkit plan --memory` (the bytes of model state,
gradients and optimizer state per rank under hsdp, fsdp, ddp and zero1, at 2 x 2, 2 x 4, 4 x 2, shapes
with 3 in them, 8 x 1 and 1 x 8) and `ddpkit plan`'s HSDP step (what goes inside a node and what
between nodes). At 2 x 2 a plan that swaps its mesh's dimensions, or a node's ranks for the nodes,
gives the right answer; at 2 x 4 it does not.

The memory plan's model is an MLP whose parameter count (51,600: 64-256-128-16) and bytes are computed
here by hand: FSDP2 cuts every tensor along dim 0 into chunks of ceil(rows / S) rows (rank 0, the rank
the plan is for, holds a full first chunk), AdamW keeps two fp32 moments per element and a 4-byte step
per tensor. The HSDP tables: tests/test_shapes_hsdp.py.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from ddpkit.errors import DdpkitError
from ddpkit.plan import links, memory, memory_fit
from ddpkit.plan.memory import MemoryJob
from ddpkit.plan.profile import Param, Profile
from ddpkit.plan.simulate import Cluster, Options, step

WIDTHS = (64, 256, 128, 16)
MODEL, SAMPLE = "test_shapes_plan:mlp", "test_shapes_plan:sample"  # what `--model` / `--sample` name


def mlp() -> nn.Module:
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(WIDTHS):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def sample(g: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, WIDTHS[0], generator=g), torch.randint(0, WIDTHS[-1], (n,), generator=g)


TENSORS = [(b, a) for a, b in itertools.pairwise(WIDTHS)] + [(b, 1) for b in WIDTHS[1:]]  # (rows, cols)
COUNT = sum(rows * cols for rows, cols in TENSORS)
assert COUNT == 51_600  # the model of the numbers: 51,600 B of fp32 parameters at shard 4


def held(shard: int) -> int:
    """Parameter bytes on rank 0 when every tensor is cut S ways along dim 0 (fp32)."""
    return 4 * sum(math.ceil(rows / shard) * cols for rows, cols in TENSORS)


def adamw(param_bytes: int, tensors: int = len(TENSORS)) -> int:
    """AdamW's state for `param_bytes` of fp32 parameters: exp_avg and exp_avg_sq, a float32 step each."""
    return 2 * param_bytes + 4 * tensors


@pytest.fixture(autouse=True, scope="module")
def _each_step_estimated_once() -> Iterator[None]:
    """One fake step per distinct job in this module (the table and the command line ask for the same);
    an estimate is a pure function of its frozen job."""
    shared = functools.cache(memory.estimate)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(memory, "estimate", shared)
        patch.setattr(memory_fit, "estimate", shared)
        yield


def _job(strategy: str, world: int, shard: int | None = None) -> MemoryJob:
    return MemoryJob(
        model=MODEL,
        sample=SAMPLE,
        micro_batch=8,
        world=world,
        strategy=strategy,
        shard_degree=shard,
        device_kind="cpu",
    )


# (strategy, world, shard degree): hsdp's R x S is world // S x S
SHARDED = [
    ("hsdp", 4, 2),  # 2 x 2
    ("hsdp", 8, 4),  # 2 x 4: 51,600 B of parameters (a swapped mesh: 103,200 B)
    ("hsdp", 8, 2),  # 4 x 2
    ("hsdp", 6, 3),  # 2 x 3: 256 / 3 and 128 / 3 rows do not split evenly: padded chunks
    ("hsdp", 6, 2),  # 3 x 2
    ("hsdp", 12, 3),  # 4 x 3
    ("hsdp", 8, 1),  # 8 x 1: every rank a whole replica
    ("hsdp", 8, 8),  # 1 x 8: one shard group, FSDP
    ("fsdp", 2, None),
    ("fsdp", 3, None),
    ("fsdp", 4, None),
    ("fsdp", 8, None),
]


@pytest.mark.parametrize(("strategy", "world", "shard"), SHARDED, ids=[f"{s}-{w}-{d}" for s, w, d in SHARDED])
def test_sharded_model_state_per_rank_over_every_shape(strategy: str, world: int, shard: int | None) -> None:
    b = memory.estimate(_job(strategy, world, shard))
    degree = shard or world  # FSDP shards over every rank; HSDP over its shard group only
    assert b.parameters == held(degree), (b.parameters, held(degree))
    assert b.optimizer_state == adamw(held(degree)), b.optimizer_state
    assert b.gradients in (0, held(degree))  # at the peak: none yet, or this rank's shard (fp32 reduce)
    if strategy == "hsdp" and 1 < shard < world:
        # R replicas of an S-way FSDP: what one rank holds at every moment of the step is FSDP over S ranks
        assert b.as_dict() == memory.estimate(_job("fsdp", shard)).as_dict()


@pytest.mark.parametrize("world", [2, 8])
def test_ddp_and_the_sharded_step_hold_whole_replicas_at_every_world_size(world: int) -> None:
    ddp, zero1 = memory.estimate(_job("ddp", world)), memory.estimate(_job("zero1", world))
    for b in (ddp, zero1):
        assert b.parameters == 4 * COUNT and b.gradients == 4 * COUNT  # DDP's buckets: every gradient
    assert ddp.optimizer_state == adamw(4 * COUNT)
    # the sharded step splits whole tensors, largest first, each to the least-loaded rank: rank 0 takes
    # the 128 x 256 weight, larger than all the others together, and nothing else, whatever the world
    largest = max(rows * cols for rows, cols in TENSORS)
    assert largest > COUNT - largest
    assert zero1.optimizer_state == adamw(4 * largest, tensors=1)


def _plan(capsys, *args: str) -> tuple[int, dict | str]:
    """`ddpkit plan --memory` as a user runs it: (exit code, the JSON plan or the error line)."""
    from ddpkit.plan import cli

    code = cli.main(
        ["--memory", "--model", MODEL, "--sample", SAMPLE, "--device", "cpu", "--device-memory", "1", *args]
    )
    out = capsys.readouterr()
    return code, json.loads(out.out) if code == 0 else out.err


# (strategy, world, shard degree) as given on the command line, and how the plan's step line names it
COMMAND_LINE = [
    ("hsdp", 4, 2, "HSDP (2 x 2)"),
    ("hsdp", 8, 4, "HSDP (2 x 4)"),
    ("hsdp", 8, 2, "HSDP (4 x 2)"),
    ("hsdp", 6, 3, "HSDP (2 x 3)"),
    ("fsdp", 8, None, "FSDP2"),
    ("fsdp", 3, None, "FSDP2"),
    ("ddp", 8, None, "DDP"),
    ("zero1", 8, None, "DDP + sharded optimizer step (ZeRO-1)"),
]


@pytest.mark.parametrize(
    ("strategy", "world", "shard", "named"),
    COMMAND_LINE,
    ids=[f"{s}-{w}" + (f"-{d}" if d else "") for s, w, d, _ in COMMAND_LINE],
)
def test_plan_memory_names_its_shape_and_the_bytes_per_rank(
    capsys, strategy: str, world: int, shard: int | None, named: str
) -> None:
    """`ddpkit plan --memory --strategy S --world W [--shard-degree K] --json -`: the step line names the
    shape (HSDP as replicate x shard), the breakdown holds the bytes computed by hand."""
    args = ["--strategy", strategy, "--world", str(world), *(["--shard-degree", str(shard)] if shard else [])]
    code, plan = _plan(capsys, *args, "--global-batch", str(8 * world), "--micro-batch", "8", "--json", "-")
    assert code == 0 and isinstance(plan, dict), plan
    assert plan["parameters"] == COUNT
    assert plan["job"].startswith(f"{named} over {world} rank(s), micro-batch 8"), plan["job"]
    b = plan["breakdown"]
    if strategy in ("fsdp", "hsdp"):
        mine = held(shard or world)
        assert (b["parameters"], b["optimizer_state"]) == (mine, adamw(mine)), b
        assert b["gradients"] in (0, mine), b
    else:  # whole replicas; the sharded step keeps the largest tensor's state only (see above)
        largest = max(rows * cols for rows, cols in TENSORS)
        state = adamw(4 * COUNT) if strategy == "ddp" else adamw(4 * largest, tensors=1)
        assert (b["parameters"], b["gradients"], b["optimizer_state"]) == (4 * COUNT, 4 * COUNT, state), b


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--strategy", "hsdp", "--world", "8", "--shard-degree", "3"], "divides the world size 8 (got 3)"),
        (["--strategy", "hsdp", "--world", "6", "--shard-degree", "4"], "divides the world size 6 (got 4)"),
        (["--strategy", "hsdp", "--world", "8"], "hsdp needs its shard degree"),
        (
            ["--strategy", "fsdp", "--world", "8", "--shard-degree", "4"],
            "--shard-degree 4 is HSDP's, not fsdp's",
        ),
        (
            ["--strategy", "zero1", "--world", "8", "--shard-degree", "2"],
            "--shard-degree 2 is HSDP's, not zero1's",
        ),
    ],
    ids=["8-shard3", "6-shard4", "no-shard", "fsdp-shard", "zero1-shard"],
)
def test_plan_memory_refuses_shapes_that_do_not_fit_in_one_line(capsys, args: list[str], says: str) -> None:
    """Refused before any estimate (an `fsdp` job with a shard degree was once estimated on HSDP's mesh
    and called FSDP2: twice FSDP's bytes), each as one line naming the fix."""
    code, err = _plan(capsys, *args, "--global-batch", "48", "--json", "-")
    assert code == 2 and isinstance(err, str), err
    assert says in err and err.count("\n") == 1 and "--shard-degree" in err, err


def test_a_shard_degree_is_refused_for_every_strategy_but_hsdp() -> None:
    for strategy in ("ddp", "zero1", "fsdp"):
        with pytest.raises(DdpkitError, match=f"is HSDP's, not {strategy}'s"):
            _job(strategy, 8, 4)
    assert _job("hsdp", 8, 4).shard_degree == 4


# -- `ddpkit plan`'s HSDP step: the shard group inside a node, the replicas across nodes --------------------
A_IN, B_IN, A_OUT, B_OUT = 5e-6, 100e9, 20e-6, 10e9  # a node's links; between nodes (one NIC per node)
UNIT = 64 << 20  # 4 FSDP units of 64 MiB: one bucket each
UNITS = 4


def _link() -> links.Link:
    intra = links.Level(name="in", alpha_s=A_IN, beta_Bps=B_IN, source="test")
    inter = links.Level(name="out", alpha_s=A_OUT, beta_Bps=B_OUT, source="test")
    return links.Link(name="two-level", intra=intra, inter=inter, nics_per_node=1)


def _units() -> Profile:
    params = tuple(
        Param(name=f"u{i}", shape=(UNIT // 4,), bytes=UNIT, ready_s=0.01 * (i + 1)) for i in range(UNITS)
    )
    return Profile(
        workload="synthetic",
        device="cpu",
        threads=1,
        batch=8,
        forward_s=0.05,
        backward_s=0.1,
        optimizer_s=0.005,
        copy_s=0.001,
        params=params,
        state_bytes=0,
    )


def _ring_allgather(n: int, nodes: int, nbytes: float) -> float:
    """A ring all-gather over n ranks on `nodes` nodes: the steps that cross a node pay the network's α,
    and the data goes at the slower of a node's and the network's bandwidth."""
    beta = B_IN if nodes == 1 else min(B_IN, B_OUT)
    return (n - nodes) * A_IN + (nodes - 1) * A_OUT + (n - 1) / n * nbytes / beta


def _ring_allreduce_across(nodes: int, nbytes: float) -> float:
    """A ring all-reduce over one rank per node."""
    if nodes == 1:
        return 0.0
    return 2 * (nodes - 1) * A_OUT + 2 * (nodes - 1) / nodes * nbytes / min(B_IN, B_OUT)


NODE_SHAPES = [(2, 2), (2, 4), (4, 2), (3, 2), (2, 3), (1, 4)]


@pytest.mark.parametrize(("nodes", "per_node"), NODE_SHAPES, ids=[f"{m}x{g}" for m, g in NODE_SHAPES])
def test_plan_hsdp_shards_inside_each_node_and_all_reduces_across_them(nodes: int, per_node: int) -> None:
    n = nodes * per_node
    cluster = Cluster(n=n, per_node=per_node, link=_link(), algorithm="ring")
    hsdp, fsdp, ddp = (step(_units(), cluster, Options(strategy=s)) for s in ("hsdp", "fsdp", "ddp"))
    # each unit: two all-gathers and a reduce-scatter (NCCL: an all-gather's cost) inside the node,
    # then one all-reduce of the node's shard between the nodes
    unit = 3 * _ring_allgather(per_node, 1, UNIT) + _ring_allreduce_across(nodes, UNIT)
    assert hsdp.comm_s == pytest.approx(UNITS * unit)
    assert fsdp.comm_s == pytest.approx(UNITS * 3 * _ring_allgather(n, nodes, UNIT))
    total = UNITS * UNIT
    slow = {  # bytes each node sends over the slow link per step (rings: (k-1)/k of the data per pass)
        "hsdp": 2 * (nodes - 1) / nodes * total,
        "fsdp": 3 * (n - 1) / n * total,
        "ddp": 2 * (n - 1) / n * total,
    }
    for name, q in (("hsdp", hsdp), ("fsdp", fsdp), ("ddp", ddp)):
        assert q.slow_link_bytes == pytest.approx(slow[name] if nodes > 1 else 0.0), name
