"""The memory plan against real ranks: two gloo ranks train the step the estimate ran on fake tensors
(benchmarks/plan_memory.py). The estimate must be within 10 % of the peak torch's CPU allocator reaches
in that step (its running total, read from the profiler's memory events: the CPU counterpart of
`torch.cuda.max_memory_allocated`), and within the stated band of the kernel's VmHWM above each rank's
baseline (which also holds memory no allocator call made). The full table (3 models, DDP and FSDP,
activation checkpointing, 2 and 4 ranks) is in docs/planning.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import run_marked

REPO = Path(__file__).resolve().parents[1]
# The measured side also holds what no tensor tracker sees (gloo's scratch, the rank's runtime
# buffers after its first step, malloc rounding): in docs/planning.md's table the estimate is 3-46 %
# (6-170 MiB) below the measured peak, never above it. So: at most 10 % above, and below by no more
# than 15 % + 128 MiB. A dropped category (the activations are half of this step) falls outside.
OVER, UNDER, SLACK = 0.10, 0.15, 128 << 20
ALLOCATOR = 0.10  # the goal, against the allocator's peak (docs/planning.md: within 1 % in every row)


@pytest.mark.timeout(300)
def test_estimate_is_within_tolerance_of_the_peak_two_real_ranks_measure(tmp_path) -> None:
    out = tmp_path / "rows.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "plan_memory.py"), "--nproc", "2", "--models", "gpt",
           "--strategies", "ddp", "fsdp", "--ac", "off", "--json", str(out)]  # fmt: skip
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
