"""`ddpkit plan`: the cost models, the overlap of buckets with backward, the link fit, and the CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist

from ddpkit.plan import cli, links, simulate
from ddpkit.plan.profile import Param, Profile, assign_buckets, interpolate
from ddpkit.plan.simulate import Cluster, Options, ring_allgather, ring_allreduce, step, tree_allreduce

MB = 1 << 20


def _profile(
    ready: list[float],
    sizes: list[int],
    *,
    forward=0.010,
    backward=0.020,
    optimizer=0.005,
    batch=8,
    threads=1,
    shapes=None,
) -> Profile:
    params = tuple(
        Param(name=f"p{i}", shape=shapes[i] if shapes else (s // 4,), bytes=s, ready_s=r)
        for i, (r, s) in enumerate(zip(ready, sizes, strict=True))
    )
    return Profile(
        workload="synthetic",
        device="cpu",
        threads=threads,
        batch=batch,
        forward_s=forward,
        backward_s=backward,
        optimizer_s=optimizer,
        copy_s=0.001,
        params=params,
        state_bytes=0,
    )


def _link(alpha=10e-6, beta=10e9, **kw) -> links.Link:
    return links.Link(
        name="test", intra=links.Level(name="t", alpha_s=alpha, beta_Bps=beta, source="test"), **kw
    )


def test_ring_tree_and_allgather_costs_follow_the_textbook_formulas() -> None:
    a, b, s = 7e-6, 25e9, 64 * MB
    for n in (2, 3, 8, 256):
        assert ring_allreduce(s, n, a, b) == pytest.approx(2 * (n - 1) * a + 2 * (n - 1) / n * s / b)
        assert tree_allreduce(s, n, a, b) == pytest.approx(2 * math.ceil(math.log2(n)) * a + 2 * s / b)
        assert ring_allgather(s, n, a, b) == pytest.approx((n - 1) * a + (n - 1) / n * s / b)
    assert ring_allreduce(s, 1, a, b) == 0.0 == tree_allreduce(s, 1, a, b) == ring_allgather(s, 1, a, b)


def test_auto_picks_the_tree_for_small_messages_and_the_ring_for_large_ones_across_nodes() -> None:
    link = links.preset("ib-ndr")
    c = Cluster(n=16, per_node=8, link=link)
    assert c.allreduce(4096)[1] == "tree"
    assert c.allreduce(1 << 30)[1] == "ring"
    # Two steps of the ring cross nodes; its bandwidth is the smaller of NVLink and the node's 8 NICs.
    t, _ = Cluster(n=16, per_node=8, link=link, algorithm="ring").allreduce(1 << 30)
    beta = min(link.intra.beta_Bps, 8 * link.inter.beta_Bps)
    latency = link.launch_s + 28 * link.intra.alpha_s + 2 * link.inter.alpha_s
    assert t == pytest.approx(latency + 30 / 16 * (1 << 30) / beta)


def test_assign_buckets_matches_torchs_bucket_assignment() -> None:
    g = torch.Generator().manual_seed(0)
    for cap_mb in (1, 4, 25):
        numels = [int(x) for x in torch.randint(1, 3_000_000, (40,), generator=g)]
        tensors = [torch.empty(n) for n in numels]  # in gradient-ready order, as DDP's rebuild passes them
        ours = assign_buckets([n * 4 for n in numels], cap_mb * MB)
        theirs, _ = dist._compute_bucket_assignment_by_size(
            tensors, [MB, cap_mb * MB], [False] * 40, list(range(40))
        )
        assert ours == [list(b) for b in theirs]


def test_a_bucket_ready_at_the_end_of_backward_is_fully_exposed() -> None:
    p = _profile([0.020], [40 * MB])  # one bucket, ready when backward ends
    c = Cluster(n=4, per_node=8, link=_link())
    pred = step(p, c, Options(bucket_cap_mb=100))
    cost = ring_allreduce(40 * MB, 4, 10e-6, 10e9)
    assert pred.exposed_s == pytest.approx(cost)
    assert pred.step_s == pytest.approx(0.010 + 0.020 + cost + 0.005)


def test_buckets_ready_early_are_hidden_behind_the_rest_of_backward() -> None:
    p = _profile([0.001, 0.002], [2 * MB, 2 * MB])  # both ready early; all-reduce ~0.6 ms each
    pred = step(p, Cluster(n=2, per_node=8, link=_link()), Options(bucket_cap_mb=1))
    assert pred.buckets == 2
    assert pred.exposed_s == pytest.approx(0.0, abs=1e-12)
    assert pred.step_s == pytest.approx(0.035)


def test_buckets_queue_on_one_stream() -> None:
    p = _profile([0.019, 0.0195], [100 * MB, 100 * MB])  # the second waits for the first
    c = Cluster(n=2, per_node=8, link=_link())
    pred = step(p, c, Options(bucket_cap_mb=50))
    cost = ring_allreduce(100 * MB, 2, 10e-6, 10e9)
    assert pred.step_s == pytest.approx(0.010 + 0.019 + 2 * cost + 0.005)


def test_efficiency_is_one_at_one_device_and_falls_with_exposed_communication(tmp_path) -> None:
    from ddpkit.plan.planner import Planner

    p = _profile([0.020], [400 * MB])
    pl = Planner(profiles={8: p}, link=_link(), per_node=8, batches={1: 8, 2: 8, 4: 8})
    curve = pl.curve([1, 2, 4], Options())
    assert curve[0].efficiency == 1.0 and curve[0].comm_s == 0.0 and curve[0].exposed_s == 0.0
    assert 1.0 > curve[1].efficiency > curve[2].efficiency > 0


def test_shared_cores_slow_compute_and_serialise_communication() -> None:
    p = _profile([0.001], [4 * MB])
    link = _link(shares_cores=True, cores=2)
    two = step(p, Cluster(n=2, per_node=4, link=link), Options())
    cost = ring_allreduce(4 * MB, 2, 10e-6, 10e9)
    assert two.exposed_s == pytest.approx(cost)  # no spare core: nothing hidden, even if ready early
    four = step(p, Cluster(n=4, per_node=4, link=link), Options())
    assert four.forward_s == pytest.approx(2 * p.forward_s)  # 4 ranks x 1 thread on 2 cores


def test_compression_hooks_shrink_the_bytes() -> None:
    p = _profile([0.02, 0.02], [1000 * 1000 * 4, 1000 * 4], shapes=[(1000, 1000), (1000,)])
    bucket = p.buckets(25)[-1]
    assert simulate.bucket_bytes(p, bucket, Options(hook="fp16")) == [bucket.bytes / 2]
    # PowerSGD rank 2: P (1000 x 2) and Q (1000 x 2) of the matrix, the bias all-reduced as it is.
    sizes = [simulate.bucket_bytes(p, b, Options(hook="powersgd", powersgd_rank=2)) for b in p.buckets(25)]
    assert sorted(x for s in sizes for x in s) == [4000.0, 8000.0, 8000.0]


def test_fit_recovers_alpha_and_beta_from_ring_times() -> None:
    for n in (2, 4):
        points = [(s, ring_allreduce(s, n, 30e-6, 2e9)) for s in (4096, 65536, MB, 16 * MB)]
        a, b = links.fit_alpha_beta(points, n)
        assert a == pytest.approx(30e-6, rel=1e-6) and b == pytest.approx(2e9, rel=1e-6)


def test_interpolation_is_linear_in_the_batch() -> None:
    lo, hi = _profile([0.01], [MB], batch=8), _profile([0.03], [MB], forward=0.030, backward=0.060, batch=24)
    mid = interpolate({8: lo, 24: hi}, 16)
    assert mid.forward_s == pytest.approx(0.020) and mid.params[0].ready_s == pytest.approx(0.02)


def _collectives_json(path, n_list=(2, 3, 4)) -> None:
    worlds = {
        str(n): [
            {"op": "all_reduce", "bytes": s, "seconds": ring_allreduce(s, n, 50e-6, 1e9)}
            for s in (4096, 65536, MB, 16 * MB)
        ]
        for n in n_list
    }
    path.write_text(json.dumps({"machine": {"cores": 2}, "worlds": worlds}))


def test_cli_plans_a_small_workload_and_writes_json_and_png(tmp_path, capsys) -> None:
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    rc = cli.main(
        [
            "--workload",
            "cnn",
            "--max-gpus",
            "16",
            "--link",
            "ib-hdr",
            "--steps",
            "2",
            "--repeats",  # one profile in one fresh process (the default's 3 and their band: test_plan_noise)
            "1",
            "--json",
            str(out),
            "--plot",
            str(png),
            "--compute-scale",
            "50",
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "efficiency" in text and "advice:" in text and "InfiniBand HDR" in text
    plan = json.loads(out.read_text())
    assert [r["n"] for r in plan["curve"]] == [1, 2, 4, 8, 16]
    assert [r["nodes"] for r in plan["curve"]] == [1, 1, 1, 1, 2]
    for key in (
        "step_s",
        "samples_per_s",
        "efficiency",
        "exposed_s",
        "comm_s",
        "per_rank_batch",
        "algorithm",
    ):
        assert all(key in r for r in plan["curve"])
    assert plan["curve"][0]["efficiency"] == 1.0
    assert {"buckets", "best_bucket_mb", "hooks", "hook_verdict", "advice", "assumptions", "profiles"} <= set(
        plan
    )
    assert png.stat().st_size > 10_000
    # The profile is reusable: a second plan over another link needs no new measurement.
    coll = tmp_path / "coll.json"
    _collectives_json(coll)
    rc = cli.main(
        [
            "--workload",
            "cnn",
            "--counts",
            "1,2,4",
            "--global-batch",
            "64",
            "--profile",
            str(out),
            "--link",
            f"measured:{coll}",
            "--json",
            "-",
        ]
    )
    assert rc == 0
    measured = json.loads(capsys.readouterr().out)
    assert [r["per_rank_batch"] for r in measured["curve"]] == [64, 32, 16]
    assert "share its 2 cores" in measured["assumptions"][0]


def test_cli_names_the_fix_when_the_link_has_no_inter_node_level(tmp_path, capsys) -> None:
    coll = tmp_path / "plan.json"
    p = _profile([0.02], [MB], batch=64)
    coll.write_text(json.dumps({"profiles": {"64": p.as_dict()}}))
    rc = cli.main(["--workload", "cnn", "--max-gpus", "16", "--link", "nvlink4", "--profile", str(coll)])
    err = capsys.readouterr().err
    assert rc == 2 and "--link ib-ndr" in err


def test_a_measured_link_uses_the_measured_curve_between_sizes(tmp_path) -> None:
    coll = tmp_path / "coll.json"
    _collectives_json(coll, n_list=(2,))
    link = links.load(f"measured:{coll}", counts=[2])
    c = Cluster(n=2, per_node=2, link=link)
    assert c.allreduce(MB)[0] == pytest.approx(ring_allreduce(MB, 2, 50e-6, 1e9))  # a measured size
    between = (ring_allreduce(MB, 2, 50e-6, 1e9) + ring_allreduce(16 * MB, 2, 50e-6, 1e9)) / 2
    assert c.allreduce(8.5 * MB)[0] == pytest.approx(between)
    assert c.allreduce(64 * MB)[0] == pytest.approx(ring_allreduce(64 * MB, 2, 50e-6, 1e9))  # extrapolated


def test_the_paper_models_have_their_published_sizes() -> None:
    from ddpkit.plan import paper

    assert sum(p.numel() for p in paper.resnet50().parameters()) == 25_557_032  # torchvision's ResNet-50
    assert 109e6 < sum(p.numel() for p in paper.Bert().parameters()) < 110e6  # BERT-base
