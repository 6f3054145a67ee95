"""The plan as a table on the terminal, as JSON, and as a PNG of efficiency against N."""

from __future__ import annotations

import json
import math
from typing import Any

from ddpkit.bench.report import table
from ddpkit.tools.plotting import pyplot


def efficiency_cell(eff: float, band: tuple[float, float] | None = None) -> str:
    """Efficiency with its noise band; above 1 it is never shown without saying it is noise:
    data parallelism cannot beat N times one device, so a figure above 1 comes from the profiles'
    run-to-run spread (or a one-device profile that was slow), not from the ranks."""
    text = f"{eff:.3f}" + (f" [{band[0]:.2f}, {band[1]:.2f}]" if band and band[0] != band[1] else "")
    if eff <= 1.0:
        return text
    if band and band[0] <= 1.0:
        return f"{text} (above 1: within noise, read 1.0)"
    return f"{text} (above 1: beyond the measured noise; re-profile with more --repeats)"


def step_cell(step_s: float, band: tuple[float, float] | None = None) -> str:
    text = f"{step_s * 1e3:.1f}"
    return text + (f" [{band[0] * 1e3:.0f}, {band[1] * 1e3:.0f}]" if band and band[0] != band[1] else "")


def curve_table(rows: list[dict[str, Any]]) -> str:
    return table(
        [
            "N",
            "nodes",
            "batch/rank",
            "step ms",
            "compute ms",
            "comm ms",
            "exposed ms",
            "samples/s",
            "speed-up",
            "efficiency",
            "all-reduce",
        ],
        [
            [
                r["n"],
                r["nodes"],
                r["per_rank_batch"],
                step_cell(r["step_s"], r.get("step_band_s")),
                (r["forward_s"] + r["backward_s"] + r["optimizer_s"]) * 1e3,
                r["comm_s"] * 1e3,
                r["exposed_s"] * 1e3,
                r["samples_per_s"],
                r["samples_per_s"] / rows[0]["samples_per_s"],
                efficiency_cell(r["efficiency"], r.get("efficiency_band")),
                r["algorithm"],
            ]
            for r in rows
        ],
    )


def sweep_table(title: str, rows: list[dict[str, Any]], label: Any) -> str:
    return table(
        [title, "step ms", "exposed ms", "samples/s"],
        [[label(r), r["step_s"] * 1e3, r["exposed_s"] * 1e3, r["samples_per_s"]] for r in rows],
    )


def text(plan: dict[str, Any]) -> str:
    out = [f"ddpkit plan: {plan['workload']}, {plan['scaling']}, profiled on {plan['profiled_on']}"]
    out += [f"  link {line}" for line in plan["link"]]
    out.append("")
    out.append(curve_table(plan["curve"]))
    if any(r.get("step_band_s") for r in plan["curve"]):
        out.append(
            f"  [low, high]: predictions from the fastest and slowest of {plan.get('repeats', 1)} "
            "repeated profiles (the step column's central value: from the median one)"
        )
    n = plan["curve"][-1]["n"]
    if n > 1:
        out.append("")
        out.append(
            sweep_table(
                f"bucket cap at N={n}", plan["buckets"], lambda r: f"{r['options']['bucket_cap_mb']:g} MB"
            )
        )
        out.append(f"  best predicted: bucket_cap_mb={plan['best_bucket_mb']:g}")
        out.append("")
        out.append(sweep_table(f"hook at N={n}", plan["hooks"], _hook_label))
        out.append(f"  {plan['hook_verdict']}")
    if plan.get("faults"):
        from ddpkit.plan import faults

        out.append("")
        out += faults.table(plan["faults"], plan["fault_options"])
    out.append("")
    out.append("advice:")
    for item in plan["advice"]:
        extra = f": {item['gain']}" if item["gain"] else ""
        cost = f" (cost: {item['cost']})" if item["cost"] and item["cost"] != "none" else ""
        out.append(f"  - {item['what']}{extra}{cost}")
    out.append("")
    out.append("assumptions:")
    out += [f"  - {a}" for a in plan["assumptions"]]
    return "\n".join(out)


def _hook_label(r: dict[str, Any]) -> str:
    o = r["options"]
    return o["hook"] + (f" rank {o['powersgd_rank']}" if o["hook"] == "powersgd" else "")


def write_json(plan: dict[str, Any], path: str) -> None:
    text_ = json.dumps(plan, indent=1, default=_default)
    if path == "-":
        print(text_)
        return
    with open(path, "w") as f:
        f.write(text_ + "\n")


def _default(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (set, tuple)):
        return list(value)
    raise TypeError(f"cannot write {type(value).__name__} as JSON")


def plot(plan: dict[str, Any], path: str) -> str:
    """Efficiency against N (log2 axis), with the exposed-communication share on a second axis."""
    plt = pyplot()
    rows = plan["curve"]
    ns = [r["n"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    ax.plot(ns, [r["efficiency"] for r in rows], "o-", color="#3366cc", label="predicted efficiency")
    for label, series in plan.get("measured", {}).items():
        ax.plot([int(k) for k in series], list(series.values()), "s--", label=f"measured: {label}")
    ax.plot(
        ns,
        [r["exposed_s"] / r["step_s"] for r in rows],
        "^:",
        color="#cc6633",
        label="exposed communication / step",
    )
    ax.axhline(1.0, color="#999999", lw=0.8)
    ax.set(
        xscale="log",
        xlabel="devices N",
        ylabel="efficiency  |  share of step",
        ylim=(0, 1.05),
        title=f"{plan['workload']} over {plan['link_name']}: predicted scaling",
    )
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
