"""The memory plan against real ranks: two gloo ranks train the step the estimate ran on fake tensors
(benchmarks/plan_memory.py). The estimate must be within 10 % of the peak torch's CPU allocator reaches
in that step (its running total, read from the profiler's memory events: the CPU counterpart of
`torch.cuda.max_memory_allocated`), and within the stated band of the kernel's VmHWM above each rank's
baseline (which also holds memory no allocator call made). The full table (3 models, DDP and FSDP,
activation checkpointing, 2 and 4 ranks) is in docs/planning.md.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
from pathlib import Path

import pytest
import torch
from conftest import run_marked

REPO = Path(__file__).resolve().parents[1]
# The measured side also holds what no tensor tracker sees (gloo's scratch, the rank's runtime
# buffers after its first step, malloc rounding): in docs/planning.md's table the estimate is 3-46 %
# (6-170 MiB) below the measured peak, never above it. So: at most 10 % above, and below by no more
# than 15 % + 128 MiB. A dropped category (the activations are half of this step) falls outside.
OVER, UNDER, SLACK = 0.10, 0.15, 128 << 20
ALLOCATOR = 0.10  # the goal, against the allocator's peak (docs/planning.md: within 2.2 % in every row)


@pytest.mark.timeout(300)
def test_estimate_is_within_tolerance_of_the_peak_two_real_ranks_measure(tmp_path) -> None:
    out = tmp_path / "rows.json"
    cmd = [
        sys.executable,
        str(REPO / "benchmarks" / "plan_memory.py"),
        "--nproc",
        "2",
        "--models",
        "gpt",
        "--strategies",
        "ddp",
        "fsdp",
        "--ac",
        "off",
        "--json",
        str(out),
    ]
    done = run_marked(cmd, timeout=280, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {r["strategy"] for r in rows} == {"ddp", "fsdp"}
    for r in rows:
        assert r["breakdown"]["activations"] > 0.3 * r["measured"]  # the step's activations: about half
        why = (r["strategy"], r["estimate"], r["measured"], r["error"])
        assert abs(r["allocator_error"]) <= ALLOCATOR, (r["strategy"], r["estimate"], r["allocator"])
        assert r["estimate"] <= (1 + OVER) * r["measured"], why
        assert r["measured"] - r["estimate"] <= UNDER * r["measured"] + SLACK, why


def test_the_allocator_peak_counts_a_block_freed_on_another_thread() -> None:
    """The measured side's own check, in one process: the allocator's peak must not keep a block that
    another thread freed (gloo's worker thread frees collective buffers, e.g. FSDP's reduce-scatter
    clone, after the caller moved on). An 8 MiB block freed on a thread, then another 8 MiB: peak 8 MiB,
    not 16 (the profiler's thread-local count alone reads 16; docs/planning.md)."""
    spec = importlib.util.spec_from_file_location("plan_memory_bench", REPO / "benchmarks" / "plan_memory.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    block = 8 << 20
    with bench._allocator_log() as prof, torch.profiler.record_function("ddpkit_step_1"):
        held = [torch.ones(block // 4)]
        other = threading.Thread(target=held.clear)  # the last reference dropped there
        other.start()
        other.join()
        again = torch.ones(block // 4)
        del again
    peak = bench._allocator_peak(prof)
    assert block <= peak < block + (1 << 20), peak / 2**20
