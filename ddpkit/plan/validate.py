"""Checking the plan against measurement on this machine (docs/planning.md).

The named workloads' global batches (64, 64, 16) are not divisible by 3, so `ddpkit bench scaling`
would skip 3 ranks; these are the same workloads with a global batch of 48 (cnn, mlp) and 24 (gpt),
divisible by 1, 2, 3 and 4:

    ddpkit plan --workload ddpkit.plan.validate:mlp48 --counts 1,2,3,4 --global-batch 48 \\
        --link measured:runs/coll/collectives.json --json runs/plan-mlp.json
    ddpkit bench scaling --workload ddpkit.plan.validate:mlp48 --max-nproc 4 --buckets 25 \\
        --hooks allreduce --out runs/scaling-mlp
    python -m ddpkit.plan.validate runs/scaling-mlp/scaling.json plan=runs/plan-mlp.json

HSDP across two hosts (benchmarks/hsdp_step.py measures and predicts; `two_hosts` gives its rows):

    python -m ddpkit.plan.validate runs/hsdp_step.json
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from typing import Any

from ddpkit.tools import workloads


def cnn48() -> workloads.Workload:
    return replace(workloads.NAMED["cnn"], name="cnn48", global_batch=48)


def mlp48() -> workloads.Workload:
    return replace(workloads.NAMED["mlp"], name="mlp48", global_batch=48)


def gpt24() -> workloads.Workload:
    return replace(workloads.NAMED["gpt"], name="gpt24", global_batch=24)


def compare(plans: dict[str, dict[str, Any]], scaling: dict[str, Any]) -> list[dict[str, Any]]:
    """Per N in the measurement: measured step (ms, spread), and each plan's prediction and error."""
    measured = {r["nproc"]: r for r in scaling["scaling"]}
    rows = []
    for n, m in sorted(measured.items()):
        row: dict[str, Any] = {
            "workload": scaling["workload"],
            "n": n,
            "measured_ms": m["step_ms"],
            "spread": m["spread"],
            "measured_efficiency": m["efficiency"],
        }
        for label, plan in plans.items():
            r = next((r for r in plan["curve"] if r["n"] == n), None)
            if r is not None:
                row[label] = {
                    "ms": r["step_s"] * 1e3,
                    "error": r["step_s"] * 1e3 / m["step_ms"] - 1,
                    "efficiency": r["efficiency"],
                    "exposed_ms": r["exposed_s"] * 1e3,
                }
        rows.append(row)
    return rows


def two_hosts(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of benchmarks/hsdp_step.py's JSON (two hosts of 2 ranks over a limited link: HSDP 2x2,
    FSDP 4, DDP 4, each measured and predicted) in `compare`'s form, labelled "plan"."""
    names = {"hsdp": "HSDP 2x2", "fsdp": "FSDP 4", "ddp": "DDP 4"}
    rows = []
    for name in result["strategies"]:
        m, p = result["measured"].get(name), result["predicted"].get(name)
        if m is None or p is None:
            continue
        rows.append(
            {
                "workload": f"{result['workload']}{result['global_batch']} {names.get(name, name)}, 2 hosts",
                "n": 4,
                "measured_ms": m["step_ms"],
                "spread": m["spread"],
                "plan": {"ms": p["step_ms"], "error": p["step_ms"] / m["step_ms"] - 1},
            }
        )
    return rows


def markdown(rows: list[dict[str, Any]], labels: list[str]) -> str:
    head = (
        "| workload | N | measured ms (spread) | " + " | ".join(f"{lb}: ms (error)" for lb in labels) + " |"
    )
    lines = [head, "|---|---|---|" + "---|" * len(labels)]
    for r in rows:
        cells = [f"{r[lb]['ms']:.1f} ({r[lb]['error']:+.0%})" if lb in r else "" for lb in labels]
        lines.append(
            f"| {r['workload']} | {r['n']} | {r['measured_ms']:.1f} (±{r['spread'] / 2:.0%}) | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


if (
    __name__ == "__main__"
):  # python -m ddpkit.plan.validate scaling.json label=plan.json [label=plan.json ...]
    with open(sys.argv[1]) as f:
        scaling_data = json.load(f)
    if "links" in scaling_data:  # python -m ddpkit.plan.validate hsdp_step.json (benchmarks/hsdp_step.py)
        print(markdown(two_hosts(scaling_data), ["plan"]))
        sys.exit(0)
    plans = {}
    for arg in sys.argv[2:]:
        label, _, path = arg.partition("=")
        with open(path) as f:
            plans[label] = json.load(f)
    print(markdown(compare(plans, scaling_data), list(plans)))
