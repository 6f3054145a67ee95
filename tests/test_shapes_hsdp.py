"""HSDP over a table of cluster shapes, not only the 2 x 2 it was built on: the degrees resolved from the
user's `HSDPOptions` and the shape (nodes x local ranks), the within-node rule, the mesh built, what the
start-up line says, and the refusals, each naming the degrees the user gave and a shape that works.

Where the ranks are more than this machine has (8 and 12), the pure rule (`ddpkit.parallel.layout.build`, via `ddpkit.strategy.layout_of`) and
torch's fake process group (its collectives return at once, nothing is sent) with a real `DeviceMesh`
on it; 4 real gloo ranks from the shared pool for 1 x 4 and 4 x 1; a real `ddpkit run --nproc 3` for a
refusal as the user sees it. Every expected value is computed here from the shape (contiguous shard
groups of S ranks, nodes of L ranks), never copied from the code's output. The memory plan's shapes:
tests/test_shapes_plan.py.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import run_cli

from ddpkit.errors import DdpkitError
from ddpkit.parallel.precision import FP32
from ddpkit.parallel.shape import Shape
from ddpkit.strategy import Chosen, layout_of
from ddpkit.strategy.hsdp import HSDP
from ddpkit.strategy.hsdp_options import HSDPOptions

SPAN = "span"  # refused: a shard group would straddle two nodes
COVER = "cover"  # refused: the degrees do not multiply to the world

# (world, local ranks per node, replicate, shard, within_node) -> (replicate, shard), or (SPAN | COVER, detail)
DEGREES = [
    # one node of 4 (the rank pools' shape): every split of 4 is inside the node
    ((4, 4, None, None, True), (1, 4)),
    ((4, 4, 2, None, True), (2, 2)),
    ((4, 4, None, 2, True), (2, 2)),
    ((4, 4, 4, None, True), (4, 1)),
    ((4, 4, None, 1, True), (4, 1)),
    ((4, 4, 1, 4, True), (1, 4)),
    # 2 nodes x 2
    ((4, 2, None, None, True), (2, 2)),
    ((4, 2, None, 4, True), (SPAN, "")),
    ((4, 2, 1, None, True), (SPAN, "")),  # shard 4 follows from replicate=1
    ((4, 2, None, 4, False), (1, 4)),
    ((4, 2, 3, None, True), (COVER, "shard would be 4/3 ranks")),
    # 2 nodes x 4: 8 ranks, shard 4
    ((8, 4, None, None, True), (2, 4)),
    ((8, 4, None, 2, True), (4, 2)),
    ((8, 4, 4, None, True), (4, 2)),
    ((8, 4, 2, 4, True), (2, 4)),
    ((8, 4, None, 8, True), (SPAN, "")),
    ((8, 4, None, 8, False), (1, 8)),
    ((8, 4, None, 3, True), (COVER, "replicate would be 8/3 ranks")),
    ((8, 4, 2, 2, True), (COVER, "replicate 2 x shard 2 = 4 ranks")),
    # 4 nodes x 2
    ((8, 2, None, None, True), (4, 2)),
    ((8, 2, None, 4, True), (SPAN, "")),
    ((8, 2, 2, None, True), (SPAN, "")),  # shard 4 follows from replicate=2
    ((8, 2, 8, None, True), (8, 1)),
    ((8, 2, None, 4, False), (2, 4)),
    # 3 nodes x 2
    ((6, 2, None, None, True), (3, 2)),
    ((6, 2, 3, None, True), (3, 2)),
    ((6, 2, None, 3, True), (SPAN, "")),
    ((6, 2, 2, None, True), (SPAN, "")),  # shard 3 follows from replicate=2
    ((6, 2, None, 3, False), (2, 3)),
    ((6, 2, 4, None, True), (COVER, "shard would be 6/4 ranks")),
    # 2 nodes x 3
    ((6, 3, None, None, True), (2, 3)),
    ((6, 3, None, 2, True), (SPAN, "")),
    ((6, 3, 3, None, True), (SPAN, "")),  # shard 2 follows from replicate=3
    ((6, 3, None, 6, False), (1, 6)),
    # 3 nodes x 4: shard 3 puts groups 1 and 2 across node boundaries (ranks 3-5, 6-8)
    ((12, 4, None, 3, True), (SPAN, "")),
    ((12, 4, 4, None, True), (SPAN, "")),  # shard 3 follows from replicate=4
    ((12, 4, None, None, True), (3, 4)),
    ((12, 4, None, 2, True), (6, 2)),
    ((12, 4, 6, None, True), (6, 2)),
    ((12, 4, None, 3, False), (4, 3)),
    # 3 ranks on one node: no degree but 1 and 3 divides them
    ((3, 3, 2, 2, True), (COVER, "replicate 2 x shard 2 = 4 ranks")),
    ((3, 3, 2, None, True), (COVER, "shard would be 3/2 ranks")),
    ((3, 3, None, 2, True), (COVER, "replicate would be 3/2 ranks")),
    ((3, 3, None, None, True), (1, 3)),
    ((3, 3, 3, None, True), (3, 1)),
    # nodes of unequal size, as a node of 4 sees a job of 6
    ((6, 4, None, None, True), (COVER, "nodes of unequal size")),
    ((6, 4, None, 2, True), (3, 2)),
    # one process
    ((1, 1, None, None, True), (1, 1)),
]


def degrees(options: HSDPOptions, shape: Shape) -> tuple[int, int]:
    """(replicate, shard) of the layout the session places for these options on this shape."""
    layout = layout_of(Chosen("hsdp", options), shape)
    return layout.replicate, layout.shard


def _id(case: tuple) -> str:
    world, local, replicate, shard, within = case
    nodes = -(-world // local)
    given = "".join(f"-{k}{v}" for k, v in (("r", replicate), ("s", shard)) if v) or "-default"
    return f"{nodes}x{local}{given}{'' if within else '-across'}"


def _shape(world: int, local: int, rank: int = 0) -> Shape:
    return Shape(
        torch.device("cpu"), rank=rank, world_size=world, local_rank=rank % local, local_world_size=local
    )


def _groups(world: int, shard: int) -> list[list[int]]:
    """HSDP's shard groups: contiguous runs of `shard` ranks (rank r holds chunk r % shard)."""
    return [list(range(k, k + shard)) for k in range(0, world, shard)]


def _inside_nodes(world: int, local: int, shard: int) -> bool:
    """Whether every shard group lies on one node (node of rank r: r // local)."""
    return all(len({r // local for r in g}) == 1 for g in _groups(world, shard))


def _given(replicate: int | None, shard: int | None) -> str:
    """The options as the user wrote them."""
    parts = [f"{k}={v}" for k, v in (("replicate", replicate), ("shard", shard)) if v is not None]
    return f"HSDPOptions({', '.join(parts)})"


@pytest.mark.parametrize(("case", "want"), DEGREES, ids=[_id(c) for c, _ in DEGREES])
def test_degrees_over_every_shape(case: tuple, want: tuple) -> None:
    world, local, replicate, shard, within = case
    options = HSDPOptions(replicate=replicate, shard=shard, within_node=within)
    shape = _shape(world, local)
    if want[0] not in (SPAN, COVER):
        r, s = want
        assert r * s == world
        assert degrees(options, shape) == want
        if within:  # the rule's reason: no shard group crosses a node boundary
            assert _inside_nodes(world, local, s), (case, want)
        return
    with pytest.raises(DdpkitError) as err:
        degrees(options, shape)
    message = str(err.value)
    if replicate or shard:
        assert _given(replicate, shard) in message, message  # the degrees the user gave, as given
    if want[0] == SPAN:
        s = shard or world // replicate
        assert not _inside_nodes(world, local, s), "the table expects a straddling group"
        assert f"shard groups of {s} ranks, which would span nodes of {local} ranks" in message, message
        assert "within_node=False" in message, message
        fix = re.search(r"e\.g\. shard=(\d+)", message)
    else:
        assert f"do not cover the {world} ranks of this job: {want[1]}" in message, message
        assert f"product is {world}" in message, message
        fix = re.search(r"e\.g\. HSDPOptions\(replicate=(\d+), shard=(\d+)\)", message)
    assert message.count("\n") == 0 and "Traceback" not in message  # one paragraph
    assert fix is not None, message
    names = ("shard",) if want[0] == SPAN else ("replicate", "shard")
    example = HSDPOptions(**dict(zip(names, map(int, fix.groups()), strict=True)))
    got = degrees(example, shape)  # the example the message offers is accepted on this very shape
    assert got[0] * got[1] == world and _inside_nodes(world, local, got[1]), (message, got)


def test_replicate_alone_names_no_shard_the_user_never_gave() -> None:
    """HSDPOptions(replicate=2) on 3 ranks: 3 / 2 is no whole shard degree, and the message says so,
    instead of the rounded-down shard=1 the degrees were once reported with."""
    with pytest.raises(DdpkitError) as err:
        degrees(HSDPOptions(replicate=2), _shape(3, 3))
    message = str(err.value)
    assert message.startswith("the degrees of HSDPOptions(replicate=2) do not cover the 3 ranks"), message
    assert "shard=1" not in message and "x shard 1" not in message, message
    assert "e.g. HSDPOptions(replicate=1, shard=3)" in message, message


@contextlib.contextmanager
def _fake_group(world: int, rank: int) -> Iterator[None]:
    """torch's fake process group: `world` ranks, this process as `rank`; torn down after."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


# (world, local, replicate, shard, within_node, the rank this process plays) -> degrees as in DEGREES
MESHES = [
    ((8, 4, None, None, True, 5), (2, 4)),
    ((8, 4, None, 2, True, 5), (4, 2)),
    ((8, 2, None, None, True, 5), (4, 2)),
    ((8, 4, None, 8, False, 6), (1, 8)),
    ((6, 2, None, None, True, 3), (3, 2)),
    ((6, 3, None, None, True, 4), (2, 3)),
    ((12, 4, None, 2, True, 7), (6, 2)),
    ((12, 4, None, 3, False, 7), (4, 3)),  # asked to cross nodes: rank 7's group is 6-8, on two nodes
    ((4, 4, 1, 4, True, 2), (1, 4)),
    ((4, 4, 4, None, True, 2), (4, 1)),
]


@pytest.mark.parametrize(("case", "want"), MESHES, ids=[f"{_id(c[:5])}-rank{c[5]}" for c, _ in MESHES])
def test_the_mesh_and_the_start_up_line_of_every_shape(case: tuple, want: tuple[int, int]) -> None:
    """The strategy a session builds for the shape, as rank `rank` of it: its degrees, the DeviceMesh it
    builds on a fake group of that many ranks (this rank's shard and replica groups), the chunk it
    holds, and the start-up line (`ddpkit: strategy hsdp over ...`) naming the mesh."""
    import torch.distributed as dist

    from ddpkit.training.choosing import Choosing

    world, local, replicate, shard, within, rank = case
    r, s = want
    options = HSDPOptions(replicate=replicate, shard=shard, within_node=within)
    shape = _shape(world, local, rank)
    strategy = HSDP(options, shape, FP32)
    assert strategy.degrees == (r, s)
    assert strategy.describe() == f"HSDP (fully_shard, replicate {r} x shard {s})"
    group = next(g for g in _groups(world, s) if rank in g)
    replicas = [rank % s + k * s for k in range(r)]  # the same chunk, one per shard group
    assert strategy.shard_index() == (rank % s, s)
    assert (len({g // local for g in group}) == 1) == within  # the rule, by hand, for this rank
    with _fake_group(world, rank):
        mesh = strategy.shape.device_mesh()
        assert mesh.mesh_dim_names == ("replicate", "shard") and tuple(mesh.shape) == (r, s)
        assert mesh["shard"].mesh.tolist() == group
        assert mesh["replicate"].mesh.tolist() == replicas
        assert dist.get_process_group_ranks(mesh.get_group("shard")) == group
        assert dist.get_process_group_ranks(mesh.get_group("replicate")) == replicas
    line = Choosing(options, shape, FP32).describe()
    nodes = -(-world // local)
    where = f"{nodes} node(s) x {local} rank(s)" if nodes > 1 else f"{world} rank(s)"
    if r > 1 and s > 1:
        assert line == f"strategy hsdp over {where}, mesh replicate {r} x shard {s}", line
    else:  # one of the degrees is 1: the mesh is 1-D in fact, the line names the ranks only
        assert line == f"strategy hsdp over {where}", line


# -- real ranks: 4 gloo ranks from the shared pool, as 1 x 4 and 4 x 1 -------------------------------------
def net_parameters() -> int:
    """fsdp_train.net(): Linear(8, 16), three Linear(16, 16) blocks, Linear(16, 4), by hand."""
    return (8 * 16 + 16) + 3 * (16 * 16 + 16) + (16 * 4 + 4)


def hsdp_rank(replicate: int, shard: int) -> dict:
    """On each pool rank: a session under HSDPOptions(replicate, shard), the model built shard by shard,
    one step on this rank's own data; what a user would check (the mesh, this rank's chunk, its groups,
    the start-up line) and the local shards after the step."""
    from fsdp_train import net

    import ddpkit

    options = HSDPOptions(replicate=replicate, shard=shard, min_block_params=1)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), ddpkit.session(seed=0, strategy=options) as s:
        model = s.model(net, strategy=options)
        params = dict(ddpkit.unwrap(model).named_parameters())
        mesh = next(iter(params.values())).device_mesh
        out = {
            "meshes": {
                n: (tuple(p.device_mesh.mesh_dim_names or ()), tuple(p.device_mesh.shape))
                for n, p in params.items()
            },
            "placements": {n: [type(pl).__name__ for pl in p.placements] for n, p in params.items()},
            "shard_group": mesh["shard"].mesh.tolist(),
            "replicate_group": mesh["replicate"].mesh.tolist(),
            "held": sum(p.to_local().numel() for p in params.values()),
            "describe": s.strategy.describe(),
        }
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(s.rank))  # other data on every rank
        s.backward(model(x).square().mean())
        s.step(opt)
        out["local"] = {n: p.to_local().detach().clone() for n, p in params.items()}
    out["printed"] = printed.getvalue()
    return out


@pytest.mark.parametrize(("replicate", "shard"), [(1, 4), (4, 1)], ids=["1x4", "4x1"])
def test_real_ranks_as_one_shard_group_and_as_four_replicas(pool4, replicate: int, shard: int) -> None:
    ranks = pool4.run(hsdp_rank, replicate, shard, timeout=120)
    total = net_parameters()
    for rank, r in enumerate(ranks):
        assert set(r["meshes"].values()) == {(("replicate", "shard"), (replicate, shard))}, r["meshes"]
        assert all(pl == ["Replicate", "Shard"] for pl in r["placements"].values()), r["placements"]
        assert r["shard_group"] == next(g for g in _groups(4, shard) if rank in g)
        assert r["replicate_group"] == [rank % shard + k * shard for k in range(replicate)]
        assert r["held"] == total // shard  # every dim 0 (16 or 4) splits evenly 4 ways: no padding
        assert r["describe"] == f"HSDP (fully_shard, replicate {replicate} x shard {shard})"
    assert "ddpkit: strategy hsdp over 4 rank(s);" in ranks[0]["printed"], ranks[0]["printed"]
    for a, b in itertools.combinations(range(4), 2):
        same_chunk = (
            a % shard == b % shard
        )  # replicas of one chunk: the all-reduce across them makes them agree
        agree = all(torch.equal(ranks[a]["local"][n], ranks[b]["local"][n]) for n in ranks[a]["local"])
        assert agree == same_chunk, (a, b, "replicas differ" if same_chunk else "chunks are the same")


# -- a refusal as the user sees it: `ddpkit run --nproc 3` -----------------------------------------------
REFUSED_SCRIPT = """
import ddpkit
from ddpkit.strategy.hsdp_options import HSDPOptions

with ddpkit.session(strategy=HSDPOptions(replicate=2, shard=2)):
    print("the session was built")
"""


@pytest.mark.timeout(150)
def test_degrees_that_do_not_fit_three_ranks_end_ddpkit_run_with_one_paragraph(tmp_path: Path) -> None:
    """Refused while the session is built, on every rank alike: the launcher prints the paragraph once,
    naming the degrees given and a shape that fits, and no rank prints a traceback."""
    script = tmp_path / "hsdp_refused.py"
    script.write_text(REFUSED_SCRIPT)
    done = run_cli("run", "--nproc", "3", str(script), timeout=120)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    paragraph = "the degrees of HSDPOptions(replicate=2, shard=2) do not cover the 3 ranks of this job"
    assert out.count(paragraph) == 1, out  # once for the job, not once per rank
    assert f"ddpkit run: {paragraph}: replicate 2 x shard 2 = 4 ranks." in done.stderr, done.stderr
    assert "e.g. HSDPOptions(replicate=1, shard=3)" in done.stderr, done.stderr
    assert "(raised by " in done.stderr, done.stderr
    assert "Traceback" not in out and "the session was built" not in out, out
