"""Checking the plan against measurement on this machine (docs/planning.md).

The named workloads' global batches (64, 64, 16) are not divisible by 3, so `ddpkit bench scaling`
would skip 3 ranks; these are the same workloads with a global batch of 48 (cnn, mlp) and 24 (gpt),
divisible by 1, 2, 3 and 4:

    ddpkit plan --workload ddpkit.plan.validate:mlp48 --counts 1,2,3,4 --global-batch 48 \\
        --link measured:runs/coll/collectives.json --json runs/plan-mlp.json
    ddpkit bench scaling --workload ddpkit.plan.validate:mlp48 --max-nproc 4 --buckets 25 \\
        --hooks allreduce --out runs/scaling-mlp
    python -m ddpkit.plan.validate runs/plan-mlp.json runs/scaling-mlp/scaling.json
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from typing import Any

from ddpkit import workloads


def cnn48() -> workloads.Workload:
    return replace(workloads.NAMED["cnn"], name="cnn48", global_batch=48)


def mlp48() -> workloads.Workload:
    return replace(workloads.NAMED["mlp"], name="mlp48", global_batch=48)


def gpt24() -> workloads.Workload:
    return replace(workloads.NAMED["gpt"], name="gpt24", global_batch=24)


def compare(plan: dict[str, Any], scaling: dict[str, Any]) -> list[dict[str, Any]]:
    """Per N present in both: predicted and measured step time (ms), error, efficiencies."""
    measured = {r["nproc"]: r for r in scaling["scaling"]}
    rows = []
    for r in plan["curve"]:
        m = measured.get(r["n"])
        if m is None:
            continue
        pred = r["step_s"] * 1e3
        rows.append(
            {
                "workload": plan["workload"],
                "n": r["n"],
                "predicted_ms": pred,
                "measured_ms": m["step_ms"],
                "spread": m["spread"],
                "error": pred / m["step_ms"] - 1,
                "predicted_efficiency": r["efficiency"],
                "measured_efficiency": m["efficiency"],
                "exposed_ms": r["exposed_s"] * 1e3,
                "measured_comm_share": m["comm_share"],
            }
        )
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| workload | N | predicted ms | measured ms (spread) | error | efficiency pred. / meas. |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['workload']} | {r['n']} | {r['predicted_ms']:.1f} | {r['measured_ms']:.1f} "
            f"(±{r['spread'] / 2:.0%}) | {r['error']:+.0%} | {r['predicted_efficiency']:.2f} / "
            f"{r['measured_efficiency']:.2f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    with open(sys.argv[1]) as f1, open(sys.argv[2]) as f2:
        print(markdown(compare(json.load(f1), json.load(f2))))
