"""The tools read the one layout. Checkpoints record it and `ddpkit checkpoint inspect` names it (the
manifest's record is the layout's own `as_dict`, the header composed from `Layout.describe`).

One choice, three readers, one layout: the session (`ddpkit.strategy.place` on its `Shape`), verify
(`VerifySpec.part`), `plan --memory` (`MemoryJob.layout`) and `plan`'s step (`Cluster.layout`) build
the layout of one HSDP choice through the one builder, so they agree on its degrees at every shape by
construction: 2 x 2, 2 x 4, 4 x 2 and 2 x 3 (at 2 x 2 a reader that swaps replicate and shard still
agrees). A strategy registered in this process is offered by the tools and laid out by them the same
way, and the tools' degree flags come from `parallel.layout.TOOL_DEGREES`. Pure: no ranks, no torch
process group (the layouts are values)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from ddpkit import strategy as strategies
from ddpkit.checkpoint import inspect
from ddpkit.errors import DdpkitError
from ddpkit.parallel import layout as layouts
from ddpkit.parallel.layout import ClusterShape, Layout, build
from ddpkit.parallel.shape import Shape
from ddpkit.plan import links, memory
from ddpkit.plan.memory import MemoryJob
from ddpkit.plan.simulate import Cluster, Options
from ddpkit.strategy import Chosen, HSDPOptions
from ddpkit.strategy.registry import registered
from ddpkit.verify.spec import VerifySpec

pytestmark = (
    pytest.mark.numerics
)  # pure values, cheap (no float compared): run under the portable kernels too

# (world, ranks per node, shard degree): HSDP replicate world // shard x shard
SHAPES = [(4, 2, 2), (8, 4, 4), (8, 2, 2), (6, 3, 3)]
IDS = [f"{w // s}x{s}" for w, _, s in SHAPES]


def _shape(world: int, local: int) -> Shape:
    return Shape(torch.device("cpu"), world_size=world, local_world_size=local)


def _verify(strategy: str, nproc: int, shard: int | None) -> VerifySpec:
    return VerifySpec(
        model="m:f", data="d:f", nproc=nproc, batch_size=12 * nproc, strategy=strategy, shard=shard
    )


def _readers(strategy: str, options: object, world: int, local: int, shard: int) -> dict[str, Layout]:
    """The layout of one choice as each reader builds it."""
    dims = strategies.entry(strategy).dims
    return {
        "session": strategies.place(Chosen(strategy, options), _shape(world, local)).layout,
        "verify": _verify(strategy, world, shard).part.layout,
        "plan --memory": MemoryJob(
            model="mlp", micro_batch=1, strategy=strategy, world=world, shard_degree=shard
        ).layout,
        "plan": Cluster(n=world, per_node=local, link=links.preset("ib-ndr")).layout(
            Options(strategy=strategy, dims=dims)
        ),
    }


@pytest.mark.parametrize(("world", "local", "shard"), SHAPES, ids=IDS)
def test_one_choice_three_readers_one_layout(world: int, local: int, shard: int) -> None:
    want = Layout(replicate=world // shard, shard=shard, dims=("replicate", "shard"))
    for options in (HSDPOptions(shard=shard), None):  # the degree given, and the default (a node's ranks)
        got = _readers("hsdp", options, world, local, shard)
        assert got == dict.fromkeys(got, want), (options, got)
    # what verify hands the session asks for exactly those degrees: the session lays it out the same
    # on verify's one machine
    spec = _verify("hsdp", world, shard)
    on_one_machine = _shape(world, world)
    assert strategies.place(strategies.resolve(spec.session_strategy()), on_one_machine).layout == want
    assert spec.part.describe() == f"HSDP({world // shard}x{shard})"
    assert (
        MemoryJob(model="mlp", micro_batch=1, strategy="hsdp", world=world, shard_degree=shard)
        .describe()
        .startswith(f"HSDP ({world // shard} x {shard}) over {world} rank(s)")
    )


@pytest.mark.parametrize("world", [4, 8, 6])
def test_verify_states_its_default_hsdp_cluster_as_two_nodes_for_the_builder(world: int) -> None:
    """Verify's choice of shape, not a second rule: with no degree its N ranks are two nodes of N/2,
    and the session's rule on that cluster gives 2 replicas of N/2."""
    two_nodes = strategies.place(Chosen("hsdp"), _shape(world, world // 2)).layout
    assert _verify("hsdp", world, None).part.layout == two_nodes
    assert (two_nodes.replicate, two_nodes.shard) == (2, world // 2)


@dataclass(frozen=True)
class SplitOptions:
    """A plug-in's options that take HSDP's two degrees."""

    replicate: int | None = None
    shard: int | None = None


def _never_built(options: object, shape: Shape, precision: object) -> strategies.Strategy:
    raise AssertionError("the tools lay a strategy out; they never build it")


@pytest.fixture
def split() -> Iterator[str]:
    """A strategy registered from outside ddpkit, spanning replicate and shard; unregistered after."""
    strategies.register("split", _never_built, options=SplitOptions, dims=("replicate", "shard"))
    try:
        yield "split"
    finally:
        registered.pop("split", None)


@pytest.mark.parametrize(("world", "local", "shard"), SHAPES, ids=IDS)
def test_a_registered_strategy_is_offered_and_laid_out_by_every_tool(split: str, world, local, shard) -> None:
    from ddpkit.plan import cli as plan_cli
    from ddpkit.plan import memory_cli
    from ddpkit.verify import cli as verify_cli

    assert split in strategies.distributed() and split in memory.offered()
    for parser in (verify_cli.build_parser(), plan_cli.build_parser(), memory_cli.build_parser()):
        strategy = next(a for a in parser._actions if "--strategy" in a.option_strings)
        assert split in strategy.choices, parser.prog
    want = Layout(replicate=world // shard, shard=shard, dims=("replicate", "shard"))
    got = _readers(split, SplitOptions(shard=shard), world, local, shard)
    assert got == dict.fromkeys(got, want), got
    assert _verify(split, world, shard).session_strategy() == SplitOptions(
        replicate=world // shard, shard=shard
    )


def test_the_tools_degree_flags_come_from_the_layouts_tool_degrees(monkeypatch: pytest.MonkeyPatch) -> None:
    """A degree added to `TOOL_DEGREES` gets `--<degree>-degree` in verify and plan --memory (and
    `--resume-<degree>-degree` in verify) with no tool edit; the value reaches the layout's reader,
    which refuses it for a strategy whose options do not take it (context: none does)."""
    from ddpkit.plan import memory_cli
    from ddpkit.verify import cli as verify_cli

    def flags(parser: object) -> dict[str, str]:
        return {o: a.help for a in parser._actions for o in a.option_strings if o.endswith("-degree")}  # type: ignore[attr-defined]

    monkeypatch.setattr(layouts, "TOOL_DEGREES", ("shard",))  # today's list: today's flags and help
    today = flags(verify_cli.build_parser())
    assert today == {
        "--shard-degree": "--strategy hsdp: ranks per shard group (default nproc / 2: 2 replicas)",
        "--resume-shard-degree": "--resume-strategy hsdp: ranks per shard group after the restart",
    }
    assert flags(memory_cli.build_parser()) == {"--shard-degree": "hsdp: ranks that share one model state"}
    monkeypatch.setattr(layouts, "TOOL_DEGREES", ("shard", "context"))  # a degree no strategy takes
    assert set(flags(verify_cli.build_parser())) == {*today, "--context-degree", "--resume-context-degree"}
    assert set(flags(memory_cli.build_parser())) == {"--shard-degree", "--context-degree"}
    ns = verify_cli.build_parser().parse_args(
        ["--model", "m:f", "--data", "d:f", "--strategy", "hsdp", "--nproc", "4", "--context-degree", "2"]
    )
    with pytest.raises(DdpkitError, match=r"context=2 \(--context-degree\) is no strategy's, not hsdp's"):
        verify_cli.spec_from_args(ns)
    job = memory_cli.build_parser().parse_args(
        ["--model", "mlp", "--strategy", "fsdp", "--context-degree", "2"]
    )
    with pytest.raises(DdpkitError, match=r"--context-degree 2 is no strategy's, not fsdp's"):
        memory_cli.make(job)


def test_inspect_names_the_mesh_a_checkpoint_was_written_on() -> None:
    hsdp = build(("replicate", "shard"), ClusterShape(4, 2))
    manifest = {"step": 3, "strategy": "hsdp", "world_size": 4, "layout": hsdp.as_dict()}
    assert "step 3, written by hsdp (replicate 2 x shard 2) at world size 4" in inspect._header(manifest)


def test_inspect_of_a_one_dimensional_layout_or_an_older_checkpoint_reads_as_before() -> None:
    fsdp = build(("shard",), ClusterShape(2, 2))
    assert "written by fsdp at world size 2" in inspect._header(
        {"strategy": "fsdp", "world_size": 2, "layout": fsdp.as_dict()}
    )
    assert "written by ddp at world size 2" in inspect._header({"strategy": "ddp", "world_size": 2})
    assert Layout.from_dict(fsdp.as_dict()) == fsdp  # what the manifest records reads back the same
