"""The parallel layout (`ddpkit.parallel.layout`): one frozen value with every degree, built by one rule per
degree from the strategy's dimensions and the cluster's shape, without a process group. Pure tables here;
one real `DeviceMesh` on torch's fake process group (nothing is sent); the import stays torch-free. The
HSDP shape table against the session's strategy: tests/test_shapes_hsdp.py."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
from conftest import fresh_python

from ddpkit.errors import DdpkitError
from ddpkit.parallel.layout import DEGREES, ClusterShape, Layout, build

HSDP = ("replicate", "shard")

# (dims, world, local ranks per node, given degrees) -> (replicate, shard, context, tensor), mesh dims
RULES = [
    (("replicate",), 4, 4, {}, (4, 1, 1, 1), ("replicate",)),  # DDP: every rank a replica
    (("shard",), 8, 4, {}, (1, 8, 1, 1), ("shard",)),  # FSDP: one copy over the whole job
    (HSDP, 8, 4, {}, (2, 4, 1, 1), HSDP),  # HSDP: shard a node, replicate across nodes
    (HSDP, 8, 4, {"shard": 2}, (4, 2, 1, 1), HSDP),
    (HSDP, 8, 4, {"replicate": 4}, (4, 2, 1, 1), HSDP),
    (HSDP, 8, 4, {"replicate": 2, "shard": 4}, (2, 4, 1, 1), HSDP),
    (HSDP, 4, 4, {}, (1, 4, 1, 1), HSDP),  # one node: 1 x 4, still the strategy's 2-D mesh
    (HSDP, 1, 1, {}, (1, 1, 1, 1), HSDP),
    (("shard", "tensor"), 8, 4, {}, (1, 2, 1, 4), ("shard", "tensor")),  # tensor: a node by default
    (("shard", "tensor"), 8, 4, {"tensor": 2}, (1, 4, 1, 2), ("shard", "tensor")),
    (("replicate", "shard", "tensor"), 16, 8, {"tensor": 2}, (2, 4, 1, 2), ("replicate", "shard", "tensor")),
    (("shard", "context"), 8, 8, {"context": 2}, (1, 4, 2, 1), ("shard", "context")),
    (("shard", "context"), 8, 8, {}, (1, 8, 1, 1), ("shard", "context")),  # context: 1 unless given
]


@pytest.mark.parametrize(("dims", "world", "local", "given", "want", "mesh_dims"), RULES)
def test_one_default_rule_per_degree(dims, world, local, given, want, mesh_dims) -> None:
    layout = build(dims, ClusterShape(world, local), **given)
    assert (layout.replicate, layout.shard, layout.context, layout.tensor) == want
    assert layout.dims == mesh_dims and layout.world == world and layout.pipeline == 1
    assert layout.data == want[0] * want[1]  # the ranks that read different batches


# (dims, world, local, given) -> what the one-paragraph refusal says
REFUSALS = [
    (HSDP, 4, 4, {"replicate": 3}, "the degrees of HSDPOptions(replicate=3) do not cover the 4 ranks"),
    (HSDP, 4, 4, {"replicate": 3, "shard": 2}, "replicate 3 x shard 2 = 6 ranks"),
    (HSDP, 6, 4, {}, "HSDP's default degrees do not cover the 6 ranks of this job: nodes of unequal size"),
    (HSDP, 8, 4, {"shard": 8, "within_node": True}, "shard groups of 8 ranks, which would span nodes of 4"),
    (("shard",), 8, 4, {"shard": 4}, "do not cover the 8 ranks of this job: shard 4"),
    (("shard",), 8, 4, {"tensor": 2}, "asks for a tensor degree, but the strategy spans only shard"),
    (("shard", "tensor"), 8, 4, {"tensor": 8}, "tensor groups of 8 ranks, which would span nodes of 4"),
    (
        ("shard", "tensor"),
        8,
        8,
        {"tensor": 3, "tensor_across_nodes": True},
        "tensor 3 = 3 ranks do not divide it",
    ),
    (HSDP, 4, 4, {"shard": 0}, "HSDPOptions(shard=0) is not a positive whole number"),
]


@pytest.mark.parametrize(("dims", "world", "local", "given", "says"), REFUSALS)
def test_a_layout_that_cannot_be_is_refused_with_the_fix(dims, world, local, given, says) -> None:
    with pytest.raises(DdpkitError) as err:
        build(dims, ClusterShape(world, local), asked_as="HSDPOptions", **given)
    message = str(err.value)
    assert says in message and message.count("\n") == 0, message


def test_within_node_and_tensor_across_nodes_are_the_ways_to_ask_for_a_slow_link_on_purpose() -> None:
    two_nodes = ClusterShape(8, 4)
    with pytest.raises(DdpkitError, match="within_node=False"):
        build(HSDP, two_nodes, replicate=1, within_node=True, asked_as="HSDPOptions")
    assert build(HSDP, two_nodes, replicate=1).mesh == (("replicate", 1), ("shard", 8))
    with pytest.raises(DdpkitError, match=r"TPOptions\(tensor_across_nodes=True\)"):
        build(("shard", "tensor"), two_nodes, tensor=8, asked_as="TPOptions")
    assert build(("tensor",), two_nodes, tensor=8, tensor_across_nodes=True).mesh == (("tensor", 8),)


def test_pipeline_is_reserved_and_a_layout_names_every_degree_it_holds() -> None:
    with pytest.raises(DdpkitError, match=r"pipeline parallelism \(a pipeline degree of 2\) is not offered"):
        Layout(pipeline=2)
    with pytest.raises(DdpkitError, match="not distinct degrees"):
        Layout(dims=("shard", "replicate"))  # not the mesh's order
    with pytest.raises(DdpkitError, match="not distinct degrees"):
        Layout(dims=("data",))
    with pytest.raises(DdpkitError, match="tensor 2 are not dimensions"):
        Layout(tensor=2, dims=("shard",))
    with pytest.raises(DdpkitError, match="not a degree of the layout"):
        Layout().coordinate(0, "pipe")
    with pytest.raises(DdpkitError, match="not degrees of the layout"):
        Layout.from_mesh({"dp": 2})


def test_describe_mesh_and_meshed() -> None:
    hsdp = Layout(replicate=2, shard=4, dims=HSDP)
    assert hsdp.describe() == "replicate 2 x shard 4" and hsdp.describe(short=True) == "2x4"
    assert hsdp.mesh == (("replicate", 2), ("shard", 4)) and hsdp.meshed
    flat = Layout(replicate=1, shard=4, dims=HSDP)  # 2-D by its strategy, 1-D in fact
    assert flat.describe() == "replicate 1 x shard 4" and not flat.meshed
    three = Layout(replicate=2, shard=2, tensor=2, dims=("replicate", "shard", "tensor"))
    assert three.describe() == "replicate 2 x shard 2 x tensor 2" and three.describe(short=True) == "2x2x2"
    assert Layout().describe() == "" and Layout().world == 1 and not Layout().meshed


def test_coordinates_and_groups_are_row_major_with_tensor_innermost() -> None:
    hsdp = Layout(replicate=2, shard=2, dims=HSDP)
    assert hsdp.groups("shard") == [[0, 1], [2, 3]] and hsdp.groups("replicate") == [[0, 2], [1, 3]]
    assert [hsdp.coordinate(r, "shard") for r in range(4)] == [0, 1, 0, 1]
    assert [hsdp.coordinate(r, "replicate") for r in range(4)] == [0, 0, 1, 1]
    assert hsdp.groups("tensor") == [[0], [1], [2], [3]] and hsdp.coordinate(3, "tensor") == 0
    three = Layout(replicate=2, shard=2, tensor=2, dims=("replicate", "shard", "tensor"))
    assert three.groups("tensor") == [[0, 1], [2, 3], [4, 5], [6, 7]]  # consecutive ranks: inside a node
    assert three.groups("shard") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert three.groups("replicate") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for dim in three.dims:  # every rank in exactly one group of each dimension, at its own coordinate
        groups = three.groups(dim)
        assert sorted(r for g in groups for r in g) == list(range(8))
        assert all([three.coordinate(r, dim) for r in g] == list(range(len(g))) for g in groups)


def test_as_dict_from_dict_and_from_mesh() -> None:
    layout = Layout(replicate=2, shard=2, tensor=2, dims=("replicate", "shard", "tensor"))
    record = layout.as_dict()
    assert record == {
        "replicate": 2,
        "shard": 2,
        "context": 1,
        "tensor": 2,
        "pipeline": 1,
        "dims": list(layout.dims),
    }
    assert Layout.from_dict(record) == layout
    assert Layout.from_dict({"shard": 4, "dims": ["shard"]}) == Layout(shard=4, dims=("shard",))
    assert Layout.from_mesh({"shard": 4, "replicate": 2}) == Layout(replicate=2, shard=4, dims=HSDP)


@contextlib.contextmanager
def _fake_group(world: int, rank: int) -> Iterator[None]:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_the_device_mesh_has_the_layouts_dims_outermost_first_and_submeshes_by_name() -> None:
    import torch.distributed as dist

    layout = build(("replicate", "shard", "tensor"), ClusterShape(8, 4), replicate=2, tensor=2)
    assert layout.mesh == (("replicate", 2), ("shard", 2), ("tensor", 2))
    rank = 5
    with _fake_group(8, rank):
        mesh = layout.device_mesh("cpu")
        assert mesh.mesh_dim_names == layout.dims and tuple(mesh.shape) == (2, 2, 2)
        for dim in layout.dims:  # torch's groups are the layout's own
            group = next(g for g in layout.groups(dim) if rank in g)
            assert mesh[dim].mesh.tolist() == group
            assert dist.get_process_group_ranks(mesh.get_group(dim)) == group
        assert mesh["replicate", "shard"].mesh.flatten().tolist() == [
            1,
            3,
            5,
            7,
        ]  # the data ranks of tensor 1


def test_the_layout_imports_without_torch() -> None:
    code = "import sys, ddpkit.parallel.layout; print('torch' in sys.modules)"
    assert fresh_python(code).strip() == "False"


def test_every_degree_is_a_field() -> None:
    assert all(hasattr(Layout(), d) for d in DEGREES)


def test_hsdp_options_carry_every_fsdp_option_with_its_default() -> None:
    """HSDPOptions is flat (no FSDPOptions base class): its FSDP part must not drift from FSDPOptions."""
    import dataclasses

    from ddpkit import FSDPOptions, HSDPOptions

    fsdp = {f.name: f.default for f in dataclasses.fields(FSDPOptions)}
    hsdp = {f.name: f.default for f in dataclasses.fields(HSDPOptions)}
    assert {n: hsdp.get(n, "missing") for n in fsdp} == fsdp
    assert HSDPOptions(blocks=None, min_block_params=7, shm=False).fsdp() == FSDPOptions(
        min_block_params=7, shm=False
    )
    assert not isinstance(HSDPOptions(), FSDPOptions)
    with pytest.raises(DdpkitError, match="min_block_params=0 is below 1"):
        HSDPOptions(min_block_params=0)  # FSDPOptions' own validation
