"""`ddpkit bench`: the arithmetic (sizes, busbw factors, spreads, recommendation) and one small real run of
each subcommand. Timing claims live in benchmarks/ and docs/performance.md, not here."""

from __future__ import annotations

import json
import sys
import time

import pytest

from ddpkit.bench import cli, collectives, floor, report, scaling, tune
from ddpkit.bench.runner import Config, Stats
from ddpkit.errors import DdpkitError
from ddpkit.tools import workloads


def test_sizes_and_nccl_tests_bus_bandwidth_factors() -> None:
    assert collectives.parse_size("4KB") == 4096 and collectives.parse_size("1.5MB") == 3 * 2**19
    assert collectives.sizes_between(4096, 2**20) == [4096, 16384, 65536, 262144, 1048576]
    assert collectives.FACTORS["all_reduce"](2) == 1.0 and collectives.FACTORS["all_reduce"](4) == 1.5
    assert collectives.FACTORS["all_gather"](4) == 0.75 and collectives.FACTORS["broadcast"](8) == 1.0
    with pytest.raises(ValueError, match="4KB"):
        collectives.parse_size("four")


def test_stats_spread_and_communication_share() -> None:
    st = Stats("x", samples=[0.9, 1.0, 1.2], no_sync=[0.7, 0.75, 0.8])
    assert st.median == 1.0 and st.spread == pytest.approx(0.3)
    assert st.comm_share == pytest.approx(0.25)
    assert Stats("y", samples=[1.0]).comm_share is None


def test_tune_never_recommends_lossy_hooks_unless_allowed() -> None:
    configs = tune.candidates(2, 2)
    assert configs[0].label.startswith("hand-written") and not configs[0].gradient_as_bucket_view
    assert any(c.nproc == 1 and c.threads == 2 for c in configs) and any(c.zero for c in configs)
    times = {c.label: 1.0 for c in configs}
    times["fp16 compression"] = 0.5
    times["ddpkit defaults + shm hook"] = 0.8
    stats = {k: Stats(k, samples=[v]) for k, v in times.items()}
    best, gain = tune.recommend(stats, configs, allow_lossy=False)
    assert best.label == "ddpkit defaults + shm hook" and gain == pytest.approx(1.25)
    assert tune.recommend(stats, configs, allow_lossy=True)[0].label == "fp16 compression"


def test_scaling_plan_skips_counts_that_do_not_divide_the_global_batch() -> None:
    configs, notes = scaling.plan(workloads.load("gpt"), 3, 1, 2, [5, 25], ["allreduce", "shm"])
    labels = [c.label for c in configs]
    assert labels == ["nproc 1", "nproc 2", "bucket 5 MB", "hook shm", "1 process x 2 threads"]
    assert "nproc 3 skipped" in notes[0]


def test_table_aligns_numbers_right() -> None:
    text = report.table(["name", "ms"], [["a", 1.5], ["bb", 100.25]])
    assert text.splitlines()[2] == "a     1.5" and text.splitlines()[3] == "bb    100"


def test_user_workload_must_be_module_function_returning_a_workload() -> None:
    with pytest.raises(DdpkitError, match="neither a named workload"):
        workloads.load("resnet")
    with pytest.raises(DdpkitError, match=r"not a ddpkit\.tools\.workloads\.Workload"):
        workloads.load("ddpkit.tools.workloads:make_mlp")
    assert workloads.load("mlp").name == "mlp"
    assert workloads.parameter_bytes(workloads.load("mlp").build()) == 37_801_994 * 4


def test_collectives_small_run(tmp_path, capsys) -> None:
    code = cli.main(
        [
            "collectives",
            "--max-size",
            "16KB",
            "--rounds",
            "1",
            "--out",
            str(tmp_path),
            "--ops",
            "all_reduce,reduce_scatter,all_reduce[shm]",
        ]
    )
    assert code == 0
    data = json.loads((tmp_path / "collectives.json").read_text())
    rows = data["worlds"]["2"]
    assert {r["op"] for r in rows} == {"all_reduce", "reduce_scatter", "all_reduce[shm]"}
    for r in rows:
        factor = collectives.FACTORS[r["op"]](2)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * factor)
    assert (tmp_path / "collectives.png").exists()
    assert "memcpy GB/s" in capsys.readouterr().out


def test_tune_small_run(tmp_path, capsys) -> None:
    assert (
        cli.main(
            [
                "tune",
                "--workload",
                "cnn",
                "--quick",
                "--rounds",
                "1",
                "--block-seconds",
                "0.05",
                "--json",
                str(tmp_path / "tune.json"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "recommendation:" in out and "speed-up" in out
    assert "memory: model state" in out and "DDP fits; FSDP not needed" in out  # the cnn is tiny
    if report.machine()["cores"] > 1:  # a one-process layout to compare with: the floor is printed
        assert "x the floor" in out and "cannot be exchanged in less than" in out
    data = json.loads((tmp_path / "tune.json").read_text())
    assert data["recommendation"]["speedup"] > 0 and data["memory"]["fsdp"] is False


def test_scaling_small_run(tmp_path) -> None:
    # 2 threads per rank: no extra "1 process x all cores" group, two process starts instead of three
    assert (
        cli.main(
            [
                "scaling",
                "--workload",
                "cnn",
                "--max-nproc",
                "2",
                "--threads",
                "2",
                "--rounds",
                "1",
                "--block-seconds",
                "0.05",
                "--buckets",
                "1,25",
                "--hooks",
                "allreduce,shm",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    data = json.loads((tmp_path / "scaling.json").read_text())
    assert [r["nproc"] for r in data["scaling"]] == [1, 2]
    assert data["scaling"][0]["efficiency"] == pytest.approx(1.0)
    assert data["scaling"][1]["comm_share"] is not None
    # A timing ratio: positive and finite. No upper bound: on a loaded 2-core machine (2 ranks x 2 threads
    # beside other jobs) it went past 2 (2.14, 2.49 seen in session 8); speed belongs to benchmarks.
    assert 0 < data["scaling"][1]["efficiency_without_comm"] < float("inf")
    assert {o["label"] for o in data["options"]} >= {"bucket 1 MB", "hook shm"}
    assert (tmp_path / "scaling.png").stat().st_size > 1000


def test_config_describe_names_what_differs() -> None:
    cfg = Config(label="x", hook="fp16", gradient_as_bucket_view=True, zero=True)
    assert (
        cfg.describe()
        == "2 proc x 1 thr, bucket 25 MB, bucket view, hook fp16 (lossy), ZeRO optimizer, glibc malloc"
    )


def test_load_note_judges_the_start_and_the_steal_not_the_runs_own_load() -> None:
    quiet = report.load_note([0.2, 0, 0], [2.0, 0, 0], 2, ((1000, 10), (2000, 20)))
    assert "steal 1%" in quiet and "provisional" not in quiet
    assert "provisional" in report.load_note([0.2, 0, 0], [2.0, 0, 0], 2, ((1000, 10), (2000, 200)))
    assert "provisional" in report.load_note([1.5, 0, 0], [2.0, 0, 0], 2)


def test_cpu_steal_reads_ticks_that_advance_with_work() -> None:
    before = report.cpu_steal()
    if not sys.platform.startswith("linux"):
        assert before is None
        return
    assert before is not None
    deadline = time.process_time() + 0.05
    while time.process_time() < deadline:  # 50 ms of CPU: at least 5 ticks at USER_HZ=100
        pass
    after = report.cpu_steal()
    assert after is not None and after[0] >= before[0] + 5, (before, after)
    assert 0 <= before[1] <= after[1] <= after[0]


def test_floor_is_the_least_exchange_at_copy_bandwidth() -> None:
    """At 2 ranks the least exchange moves 4.5 x the gradient bytes (read + written), at twice the copy
    bandwidth in traffic: 100 MB at 10 GB/s copied is 22.5 ms; ddpkit's own step moves 5.5 x."""
    assert floor.ideal_traffic(100e6, 2) == pytest.approx(450e6)
    assert floor.ddpkit_traffic(100e6, 2) == pytest.approx(550e6)
    assert floor.exchange_floor_s(100e6, 2, 10e9) == pytest.approx(0.0225)
    assert floor.exchange_floor_s(100e6, 1, 10e9) == 0.0
    line = floor.floor_line(0.2, 0.1, 100e6, 2, 10e9)
    assert "22.5 ms" in line and "floor is 122 ms (1.22x it)" in line and "1.63x the floor" in line
    assert floor.copy_bandwidth(nbytes=2**20, reps=2) > 0


def test_fsdp_floor_counts_fsdp2s_copies_and_the_least_exchange() -> None:
    """FSDP's least exchange at W ranks moves G (7W + 5) / W (9.5 G at 2 ranks: two all-gathers of
    G (W+1)/W copied, a reduce-scatter of 3 G + G/W read + written); ddpkit's path 15.5 G (11.5 G with
    the all-gather output in shared memory). The floor adds it to the compute at twice the copy rate
    and stretches both by W / cores when ranks outnumber cores."""
    assert floor.fsdp_traffic(100e6, 2) == pytest.approx(950e6)
    assert floor.fsdp_traffic(100e6, 4) == pytest.approx(825e6)
    assert floor.fsdp_ddpkit_traffic(100e6, 2) == pytest.approx(1550e6)
    assert floor.fsdp_ddpkit_traffic(100e6, 2, shared_output=True) == pytest.approx(1150e6)
    assert floor.fsdp_floor_s(0.1, 100e6, 2, 10e9, cores=2) == pytest.approx(0.1475)
    assert floor.fsdp_floor_s(0.1, 100e6, 4, 10e9, cores=2) == pytest.approx(0.2825)
    assert floor.fsdp_floor_s(0.1, 100e6, 1, 10e9, cores=2) == pytest.approx(0.1)
    line = floor.fsdp_floor_line(0.295, 0.1, 100e6, 2, 10e9, cores=2)
    assert "950 MB" in line and "(48 ms)" in line and "= 148 ms" in line and "2.00x the floor" in line
    assert "moves 1150 MB" in line and "moves 1550 MB" in floor.fsdp_floor_line(
        0.3, 0.1, 100e6, 2, 10e9, 2, False
    )
