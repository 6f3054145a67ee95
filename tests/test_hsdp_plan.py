"""`ddpkit plan` knows HSDP: its step (the shard group's all-gathers and reduce-scatters on a node's links,
one all-reduce of the node's shards between nodes), the bytes each node sends over the slow link, and
the advice that names it where FSDP is needed on several nodes; `ddpkit bench tune --nodes N` names
HSDP's shape in its memory line. Pure: the cost model on synthetic profiles and a preset link, no ranks."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_plan import MB, _link, _profile

from ddpkit.plan import links
from ddpkit.plan.advice import advise
from ddpkit.plan.planner import Planner
from ddpkit.plan.simulate import Cluster, Options, step

pytestmark = pytest.mark.numerics  # pure arithmetic, cheap: run again under the portable kernels too


def _big() -> object:  # 8 units of 64 MiB of gradients, ready through the backward
    return _profile([0.002 * (i + 1) for i in range(8)], [64 * MB] * 8, forward=0.05, backward=0.1)


def test_hsdp_on_one_node_is_fsdp() -> None:
    cluster = Cluster(n=8, per_node=8, link=links.preset("ib-ndr"))
    fsdp, hsdp = (
        step(_big(), cluster, Options(strategy="fsdp")),
        step(_big(), cluster, Options(strategy="hsdp")),
    )
    assert hsdp.step_s == pytest.approx(fsdp.step_s) and hsdp.comm_s == pytest.approx(fsdp.comm_s)
    assert hsdp.slow_link_bytes == fsdp.slow_link_bytes == 0.0


def test_across_nodes_hsdp_sends_less_over_the_slow_link_and_steps_faster_than_fsdp() -> None:
    """Cloud nodes (PCIe inside, one 100 GbE NIC between): HSDP's communication is shorter than FSDP's.
    (With a NIC per GPU, ib-ndr, the model gives FSDP's rings the node's 8 NICs: HSDP then sends half
    the bytes between nodes but its step's communication is about FSDP's.)"""
    link = links.preset("eth-100g")
    cluster = Cluster(n=32, per_node=8, link=link)  # 4 nodes x 8
    fsdp, hsdp = (
        step(_big(), cluster, Options(strategy="fsdp")),
        step(_big(), cluster, Options(strategy="hsdp")),
    )
    total = 8 * 64 * MB
    assert fsdp.slow_link_bytes == pytest.approx(3 * 31 / 32 * total)  # two all-gathers + a reduce-scatter
    assert hsdp.slow_link_bytes == pytest.approx(2 * 3 / 4 * total)  # one all-reduce between the 4 nodes
    ddp = step(_big(), cluster, Options(strategy="ddp"))
    assert ddp.slow_link_bytes == pytest.approx(2 * 31 / 32 * total)
    assert hsdp.comm_s < fsdp.comm_s, (hsdp.comm_s, fsdp.comm_s)
    # HSDP's comm: the node's FSDP (3 collectives on PCIe) plus the all-reduce of 64 MiB per unit between nodes
    inside, across = Cluster(n=8, per_node=8, link=link), Cluster(n=4, per_node=1, link=link)
    want = sum(3 * inside.allgather(64 * MB) + across.allreduce(64 * MB)[0] for _ in range(8))
    assert hsdp.comm_s == pytest.approx(want)


def test_plan_advises_hsdp_where_fsdp_is_needed_on_several_nodes() -> None:
    p = _big()
    pl = Planner(profiles={8: p}, link=links.preset("ib-ndr"), per_node=8, batches={1: 8, 16: 8})
    at = pl.predict(16, Options())
    state = 2 * p.param_bytes + p.state_bytes  # 1 GiB: needs FSDP on a 0.5 GB device, fits 8 ways
    items = advise(pl, 16, Options(), at, strong=False, device_memory_gb=0.5)
    hsdp = [i for i in items if i["what"].startswith("HSDP")]
    assert hsdp, [i["what"] for i in items]
    assert "shard inside each node (8 ranks), replicate across the 2 nodes" in hsdp[0]["what"]
    assert f"{state / 8 / 1e9:.2f} GB of model state per device" in hsdp[0]["what"]
    assert 'strategy="hsdp"' in hsdp[0]["cost"]
    one_node = Planner(profiles={8: p}, link=_link(), per_node=16, batches={1: 8, 16: 8})
    items = advise(
        one_node, 16, Options(), one_node.predict(16, Options()), strong=False, device_memory_gb=0.5
    )
    assert not [i for i in items if i["what"].startswith("HSDP")]  # one node: HSDP is FSDP


@pytest.mark.parametrize(
    ("state_gb", "nodes", "shape", "says"),
    [
        (1.0, 2, "ddp", "DDP fits; FSDP not needed"),
        (10.0, 1, "fsdp 4", "use strategy='fsdp'"),
        (
            10.0,
            2,
            "hsdp 2x4",
            "on 2 nodes x 4 ranks use strategy='hsdp' instead: replicate 2 x shard 4, 2.50 GB",
        ),
        (
            40.0,
            2,
            "fsdp 8",
            "a node's share (10.00 GB per rank sharded 4 ways) does not fit either, so FSDP over "
            "all 8 ranks (5.00 GB per rank), not HSDP",
        ),
    ],
)
def test_bench_tune_names_the_hsdp_shape_where_a_node_share_fits(state_gb, nodes, shape, says) -> None:
    """4 ranks per machine of 8 GB each (80% usable): 10 GB of model state needs sharding; 4 ways per
    node it fits, so across 2 nodes HSDP(2x4); 40 GB does not fit a node's 4 ranks: FSDP over all 8."""
    from ddpkit.bench.tune import memory_line
    from ddpkit.strategy.choice import verdict

    named, text = memory_line(verdict(int(state_gb * 1e9), int(8e9), 4), nodes, 4)
    assert named == shape and says in text, text


def _two_hosts() -> links.Link:
    """What benchmarks/hsdp_step.py measures: gloo all-reduces inside a host (2 ranks, ~1 GB/s) and between
    one rank per host over a 200 Mbit/s link, t = 2(n-1)·α + 2(n-1)/n·S/β at n = 2, fitted back."""

    def rows(level: str, alpha: float, beta: float) -> list[dict]:
        sizes = (64 * 1024, MB, 4 * MB, 8 * MB)
        return [
            {"level": level, "op": "all_reduce", "bytes": s, "seconds": 2 * alpha + s / beta} for s in sizes
        ]

    return links.two_level([*rows("intra", 300e-6, 1e9), *rows("inter_alone", 1e-3, 25e6)], cores=2)


def test_a_two_host_link_fits_each_level_and_is_gloo() -> None:
    link = _two_hosts()
    assert link.intra.at(2) == pytest.approx((300e-6, 1e9), rel=1e-6)
    assert link.inter is not None and link.inter.at(2) == pytest.approx((1e-3, 25e6), rel=1e-6)
    assert link.backend == "gloo" and link.nics_per_node == 1
    assert any("reduce-scatter costs an all-reduce" in line for line in link.describe())


def test_on_gloo_a_reduce_scatter_costs_an_all_reduce_so_fsdp_sends_four_passes() -> None:
    """gloo's reduce_scatter_tensor (FSDP2's) all-reduces the whole input and keeps a chunk: measured on two
    hosts (benchmarks/hsdp_step.py) it takes the all-reduce's time, and FSDP(4) sent 63.7 MB per node per
    step for 21.2 MB of parameters, 4 x 3/4, not the ring's 3 x 3/4. NCCL's is a ring: an all-gather's cost."""
    gloo, nccl = _two_hosts(), links.preset("eth-100g")
    for link in (gloo, nccl):
        cluster = Cluster(n=4, per_node=2, link=link)
        want = cluster.allreduce(8 * MB)[0] if link.backend == "gloo" else cluster.allgather(8 * MB)
        assert cluster.reduce_scatter(8 * MB) == pytest.approx(want)
    cluster = Cluster(n=4, per_node=2, link=gloo)
    p = _profile([0.01, 0.02], [MB, 8 * MB], forward=0.05, backward=0.1)
    fsdp, hsdp = step(p, cluster, Options(strategy="fsdp")), step(p, cluster, Options(strategy="hsdp"))
    assert fsdp.slow_link_bytes == pytest.approx(4 * 3 / 4 * 9 * MB)
    assert hsdp.slow_link_bytes == pytest.approx(9 * MB)  # the shard all-reduce: 2 x 1/2 of S per node
    assert fsdp.comm_s == pytest.approx(
        sum(2 * cluster.allgather(s) + cluster.allreduce(s)[0] for s in (MB, 8 * MB))
    )
    inside, across = Cluster(n=2, per_node=2, link=gloo), Cluster(n=2, per_node=1, link=gloo)
    want = sum(
        2 * inside.allgather(s) + inside.allreduce(s)[0] + across.allreduce(s)[0] for s in (MB, 8 * MB)
    )
    assert hsdp.comm_s == pytest.approx(want)
    assert across.allreduce(8 * MB)[0] == pytest.approx(2e-3 + 8 * MB / 25e6, rel=1e-3)  # the slow link's β


def test_ddp_across_nodes_on_busy_cores_waits_for_the_wire_beside_the_backward() -> None:
    """4 CPU ranks on 2 cores (no core left over): DDP's all-reduce over the slow link is mostly waiting on
    the wire, which gloo's threads do beside the backward; only its copies (the same all-reduce at one
    node's speed) take the cores. So the step is the backward plus the copies, or the wire's end if later,
    not backward + all-reduce (measured: 2144 ms against 3428 predicted when it was added)."""
    cluster = Cluster(n=4, per_node=2, link=_two_hosts())
    one_node = Cluster(n=4, per_node=4, link=_two_hosts())
    backward = 0.1
    p = _profile([0.05, backward], [MB, 8 * MB], forward=0.05, backward=backward, optimizer=0.0)
    p = replace(p, ranks=4)  # profiled 4 side by side: the times as they are, no straggler
    q = step(p, cluster, Options(strategy="ddp"))
    wire = [cluster.allreduce(s)[0] for s in (MB, 8 * MB)]
    cpu = [one_node.allreduce(s)[0] for s in (MB, 8 * MB)]
    end = max(0.05 + wire[0], backward + cpu[0]) + wire[1]  # the second bucket starts after the first
    assert q.step_s == pytest.approx(0.05 + max(backward + sum(cpu), end))
    assert q.step_s < 0.05 + backward + sum(wire)  # the old serial sum
    assert q.comm_s == pytest.approx(sum(wire))


def test_the_two_host_benchmark_gives_validation_rows() -> None:
    """benchmarks/hsdp_step.py's JSON as rows of the plan's validation table (python -m ddpkit.plan.validate)."""
    from ddpkit.plan.validate import markdown, two_hosts

    result = {
        "workload": "gpt",
        "global_batch": 24,
        "strategies": ["hsdp", "ddp"],
        "measured": {"hsdp": {"step_ms": 4000.0, "spread": 0.2}, "ddp": {"step_ms": 2000.0, "spread": 0.1}},
        "predicted": {"hsdp": {"step_ms": 3600.0}, "ddp": {"step_ms": 2500.0}},
    }
    text = markdown(two_hosts(result), ["plan"])
    assert "| gpt24 HSDP 2x2, 2 hosts | 4 | 4000.0 (±10%) | 3600.0 (-10%) |" in text, text
    assert "| gpt24 DDP 4, 2 hosts | 4 | 2000.0 (±5%) | 2500.0 (+25%) |" in text, text
