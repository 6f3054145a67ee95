"""`ddpkit plan`'s fault section (`ddpkit.plan.faults`): the expected training time lost to faults with disk
checkpoints only and with memory snapshots, as pure functions and through the plan's flags."""

from __future__ import annotations

import pytest

from ddpkit.plan import faults
from ddpkit.plan.cli import build_parser
from ddpkit.plan.faults import FaultModel, expected_loss

# 7B under FSDP: 12 B per parameter (fp32 weights, AdamW's two moments), a 6.6 s step of 4M tokens
SEVEN_B = {"step_s": 6.6, "state_bytes": 84e9}


def test_the_default_rate_is_llama_3s_one_interruption_per_50_700_gpu_hours() -> None:
    rate = faults.LLAMA3_RATE
    assert rate == pytest.approx(1.973e-5, rel=1e-3) and 1 / rate == pytest.approx(50_700, rel=1e-3)
    assert expected_loss(FaultModel(devices=16384, **SEVEN_B)).job_faults_per_hour == pytest.approx(
        1 / 3.1, rel=0.01
    )


def test_at_scale_memory_snapshots_cut_what_faults_cost() -> None:
    # as run in practice at 16K GPUs: disk every 30 min with a 30 s stall, a 600 s restart
    practice = {"save_stall_s": 30.0, "disk_interval_s": 1800.0, "restart_s": 600.0}
    lost = expected_loss(FaultModel(devices=16384, snapshot_s=0.005 * 6.6, **practice, **SEVEN_B))
    assert lost.disk.share == pytest.approx(0.152, abs=0.001)  # half an interval + restart + read per fault
    assert lost.memory.share == pytest.approx(0.057, abs=0.001) and lost.memory.every == 4


def test_at_tens_of_gpus_snapshots_are_rare_and_a_dear_snapshot_is_taken_less_often() -> None:
    cheap = expected_loss(FaultModel(devices=64, snapshot_s=0.002 * 6.6, **SEVEN_B))
    dear = expected_loss(FaultModel(devices=64, snapshot_s=0.02 * 6.6, **SEVEN_B))
    assert 1 < cheap.memory.every < dear.memory.every  # Young's N in steps grows with the cost
    assert cheap.memory.share < dear.memory.share < cheap.disk.share


def _rows(*flags: str) -> list[dict]:
    ns = build_parser().parse_args(["--workload", "gpt", *flags])
    curve = [{"n": n, "step_s": 6.6} for n in (64, 1024, 16384)]
    return faults.section(curve, int(7e9 * 4), ns, per_node=8)


def test_the_plans_fault_flags_reach_the_section() -> None:
    base = _rows()
    assert [r["faults_per_hour"] for r in base] == pytest.approx(
        [faults.LLAMA3_RATE * n for n in (64, 1024, 16384)]
    )
    faster = _rows("--fault-rate", "2e-4")
    assert all(f["disk_share"] > b["disk_share"] for f, b in zip(faster, base, strict=True))
    longer = _rows("--restart-s", "1200")
    assert all(x["memory_share"] > b["memory_share"] for x, b in zip(longer, base, strict=True))
    text = "\n".join(
        faults.table(base, {k: getattr(build_parser().parse_args([]), k) for k in faults.OPTIONS})
    )
    assert "16384" in text and "memory snapshots: lost" in text and "Dubey et al. 2024" in text


def test_the_storage_interval_snapshot_cost_and_optimizer_flags_reach_the_section() -> None:
    """Each of the other fault flags moves the figure it feeds: slower storage and more optimizer state
    make a disk checkpoint dearer (a longer interval: more lost), a dearer snapshot is taken less often,
    and a disk interval given is the one used."""
    base = _rows()
    slower = _rows("--storage-gbps", "1")
    assert all(s["disk_share"] > b["disk_share"] for s, b in zip(slower, base, strict=True))
    more_state = _rows("--optimizer-states", "6")
    assert all(m["disk_share"] > b["disk_share"] for m, b in zip(more_state, base, strict=True))
    dear = _rows("--snapshot-cost", "0.5")
    assert all(d["memory_every"] >= b["memory_every"] for d, b in zip(dear, base, strict=True))
    assert any(d["memory_every"] > b["memory_every"] for d, b in zip(dear, base, strict=True))
    fixed = _rows("--disk-interval-s", "7200")
    assert [f["disk_interval_s"] for f in fixed] == [7200.0] * 3
