"""The memory plan against the kernel: two real gloo ranks train the step the estimate ran on fake
tensors, and their measured peak (VmHWM above each rank's baseline, benchmarks/plan_memory.py) must
be within the tolerance of the tracked peak. The full table (3 models, DDP and FSDP, activation
checkpointing, 2 and 4 ranks) is in docs/planning.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import run_marked

REPO = Path(__file__).resolve().parents[1]
# The measured side also holds what no tensor tracker sees (gloo's scratch, DDP's reducer, page and
# malloc rounding); the table's worst row is stated in docs/planning.md. A dropped category (e.g. the
# activations, most of this step) moves the estimate far outside this band.
TOLERANCE = 0.20


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
        assert r["breakdown"]["activations"] > 0.3 * r["measured"]  # the step's activations are most of it
        assert abs(r["error"]) <= TOLERANCE, (r["strategy"], r["estimate"], r["measured"], r["error"])
