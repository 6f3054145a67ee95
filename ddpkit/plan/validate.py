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

Tensor parallelism against FSDP and DDP on 2 ranks (benchmarks/tp_vs_fsdp.py measures; `stack64` is
its model as a workload, one plan per strategy and global batch; `side_by_side` gives the rows):

    ddpkit plan --workload ddpkit.plan.validate:stack64 --strategy tp --tensor-degree 2 \
        --tp-plan '{"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}' --counts 1,2 \
        --global-batch 64 --link measured:runs/coll/collectives.json --json runs/plan-tp64.json
    python benchmarks/tp_vs_fsdp.py --batches 64 --rounds 5 --names tp,torch-tp,half,local,ddp \
        --json runs/tp_vs_fsdp.json
    python -m ddpkit.plan.validate runs/tp_vs_fsdp.json runs/plan-tp64.json [runs/plan-ddp64.json ...]
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ddpkit.tools import workloads


def cnn48() -> workloads.Workload:
    return replace(workloads.NAMED["cnn"], name="cnn48", global_batch=48)


def mlp48() -> workloads.Workload:
    return replace(workloads.NAMED["mlp"], name="mlp48", global_batch=48)


def gpt24() -> workloads.Workload:
    return replace(workloads.NAMED["gpt"], name="gpt24", global_batch=24)


class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(STACK_D, STACK_HIDDEN)
        self.down = nn.Linear(STACK_HIDDEN, STACK_D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class Stack(nn.Module):
    """benchmarks/tp_vs_fsdp.py's model: 4 x (Linear 512->2048, GELU, Linear 2048->512) with residuals."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Pair() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


STACK_D, STACK_HIDDEN = 512, 2048
STACK_PLAN = {
    "blocks.*.up": "colwise",
    "blocks.*.down": "rowwise",
}  # Megatron's pair: one all-reduce each way


def _stack_sample(g: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, STACK_D, generator=g), torch.zeros(n)


def _mean_square(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return out.square().mean()  # the benchmark's loss; the target is a placeholder


def stack64() -> workloads.Workload:
    """The tensor-parallel validation's workload: `Stack`, SGD, the loss mean(out^2) (the benchmark's),
    global batch 64 (TP(2): 64 per tensor group)."""
    return workloads.Workload(
        name="stack64",
        build=Stack,
        optimizer=lambda p: torch.optim.SGD(p, lr=1e-3),
        sample=_stack_sample,
        global_batch=64,
        loss=_mean_square,
    )


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


def side_by_side(result: dict[str, Any], plans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of benchmarks/tp_vs_fsdp.py's JSON (TP(2), FSDP(2), DDP(2) of `stack64`'s model, each
    global batch measured) against the plans made for them, in `compare`'s form, labelled "plan": each
    plan is matched to the measurement by its strategy and global batch, at its largest N; a TP plan
    also to torch's TP alone where the benchmark timed it (`--names ...,torch-tp`)."""
    rows = []
    for plan in plans:
        strategy = plan["options"]["strategy"]
        last = max(plan["curve"], key=lambda r: r["n"])
        t = plan["options"].get("tensor", 1)
        batch = last["per_rank_batch"] * last["n"] // t  # TP: one batch per tensor group
        by_name = result["ms_per_step"].get(str(batch), {})
        label = f"TP({t})" if strategy == "tp" else f"{strategy.upper()}({last['n']})"
        # a TP plan also against torch's TP alone (no FSDP2 over the data mesh, no dispatch mode)
        against = [(strategy, label)] + ([("torch-tp", f"torch's TP({t}) alone")] if strategy == "tp" else [])
        for name, text in against:
            m = by_name.get(name)
            if m is None:
                continue
            low, high = m["spread_ms"]
            rows.append(
                {
                    "workload": f"{plan['workload']} batch {batch} {text}",
                    "n": last["n"],
                    "measured_ms": m["median_ms"],
                    "spread": (high - low) / m["median_ms"],
                    "plan": {"ms": last["step_s"] * 1e3, "error": last["step_s"] * 1e3 / m["median_ms"] - 1},
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
    if "ms_per_step" in scaling_data:  # tp_vs_fsdp.json plan.json ... (benchmarks/tp_vs_fsdp.py)
        given = []
        for path in sys.argv[2:]:
            with open(path) as f:
                given.append(json.load(f))
        print(markdown(side_by_side(scaling_data, given), ["plan"]))
        sys.exit(0)
    plans = {}
    for arg in sys.argv[2:]:
        label, _, path = arg.partition("=")
        with open(path) as f:
            plans[label] = json.load(f)
    print(markdown(compare(plans, scaling_data), list(plans)))
