"""Markdown tables for docs/performance.md from the JSON the benchmarks write.

    python benchmarks/tables.py runs/final        # reads overhead.json, peers.json, tune-mlp.json,
                                                  # collectives/collectives.json, scaling-gpt/scaling.json

Prints each table under a heading; missing files are skipped. Keeps the document's figures tied to
files anyone can regenerate with the commands in docs/performance.md.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from typing import Any


def _load(folder: str, name: str) -> Any:
    path = os.path.join(folder, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def md(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _ratio(a: list[float], b: list[float]) -> str:
    r = [x / y for x, y in zip(a, b, strict=True)]
    return f"{statistics.median(r):.2f} [{min(r):.2f}, {max(r):.2f}]"


def _ms(samples: list[float]) -> str:
    med = statistics.median(samples)
    return f"{med * 1e3:.1f} ±{(max(samples) - min(samples)) / med / 2:.0%}"


def overhead(d: dict) -> str:
    rows = []
    for spec, r in d["workloads"].items():
        med, lo, hi = r["ratio_same_settings"]
        dmed, dlo, dhi = r["ratio_vs_torch_defaults"]
        rows.append(
            [
                spec,
                f"{r['plain_ms']:.1f}",
                f"{r['ddpkit_ms']:.1f}",
                f"**{med:.3f}** [{lo:.3f}, {hi:.3f}]",
                f"{dmed:.3f} [{dlo:.3f}, {dhi:.3f}]",
            ]
        )
    return md(
        [
            "workload",
            "hand-written DDP, ms",
            "ddpkit, ms",
            "ratio, same settings",
            "ratio vs DDP with torch defaults",
        ],
        rows,
    )


def peers(d: dict) -> str:
    out = []
    keys = ["single1", "single2", "ddp", "ddpkit", "ddpkit-shm", "accelerate", "fabric"]
    names = [
        "1 proc x 1 thr",
        "1 proc x 2 thr",
        "hand-written DDP",
        "ddpkit",
        "ddpkit + shm hook",
        "Accelerate",
        "Fabric",
    ]
    rows = [[spec] + [_ms(t[k]) for k in keys] for spec, t in d["warm"].items()]
    out.append("Step time, ms (median over rounds ±half the spread):\n\n" + md(["workload", *names], rows))
    rows = [
        [
            spec,
            _ratio(t["ddpkit"], t["ddp"]),
            _ratio(t["ddpkit"], t["accelerate"]),
            _ratio(t["ddpkit"], t["fabric"]),
            _ratio(t["ddpkit-shm"], t["ddp"]),
        ]
        for spec, t in d["warm"].items()
    ]
    heads = ["workload", "ddpkit / DDP", "ddpkit / Accelerate", "ddpkit / Fabric", "ddpkit+shm / DDP"]
    out.append(
        "Per-round step-time ratios, median [min, max] (below 1: ddpkit faster):\n\n" + md(heads, rows)
    )
    variants = ["single", "ddp", "ddpkit", "accelerate", "fabric"]
    launch = ["`python` (1 proc)", "torchrun + DDP", "`ddpkit run`", "torchrun + Accelerate", "`fabric run`"]
    rows = []
    for spec, runs in d.get("cold", {}).items():
        ttfs = [f"{statistics.median(r['ttfs_s'] for r in runs[v]):.2f} s" for v in variants]
        rows.append([f"{spec}: time to first step", *ttfs])
        mem = [f"{statistics.median(m for r in runs[v] for m in r['peak_rss_mb']):.0f} MB" for v in variants]
        rows.append([f"{spec}: peak RSS per rank", *mem])
    if rows:
        out.append(
            "Cold start (median of runs; each tool started by its own launcher):\n\n"
            + md(["", *launch], rows)
        )
    return "\n\n".join(out)


def tune(d: dict) -> str:
    base = d["configs"][0]["median_s"]
    rows = []
    for c in sorted(d["configs"], key=lambda c: c["median_s"]):
        lossy = c["hook"] in ("fp16", "bf16", "powersgd")
        tag = " (lossy)" if lossy else " (changes your optimizer)" if c.get("fused") else ""
        rows.append(
            [
                c["label"] + tag,
                f"{c['median_s'] * 1e3:.0f}",
                f"±{c['spread'] / 2:.0%}",
                f"{base / c['median_s']:.2f}x",
            ]
        )
    rec = d["recommendation"]
    return (
        md(["configuration", "step ms (median)", "spread", "vs hand-written DDP"], rows)
        + f"\n\nRecommendation: **{rec['label']}, {rec['speedup']:.2f}x**."
    )


def collectives(d: dict) -> str:
    rows = []
    by = {(r["op"], r["bytes"]): r for r in d["worlds"]["2"]}
    for size in d["sizes"]:
        g, s = by.get(("all_reduce", size)), by.get(("all_reduce[shm]", size))
        if not g or not s:
            continue
        rows.append(
            [
                _human(size),
                f"{g['seconds'] * 1e3:.2f}",
                f"{g['busbw_GBps']:.2f}",
                f"{s['seconds'] * 1e3:.2f}",
                f"{s['busbw_GBps']:.2f}",
                f"{g['seconds'] / s['seconds']:.1f}x",
                f"{d['memcpy_GBps'][str(size)]:.1f}",
            ]
        )
    return md(
        [
            "size",
            "gloo all_reduce ms",
            "gloo busbw",
            "shm all_reduce ms",
            "shm busbw",
            "shm speed-up",
            "memcpy GB/s",
        ],
        rows,
    )


def scaling(d: dict) -> str:
    rows = [
        [
            r["nproc"],
            r["threads"],
            f"{r['step_ms']:.0f}",
            f"±{r['spread'] / 2:.0%}",
            f"{r['samples_per_s']:.1f}",
            f"{r['efficiency']:.2f}",
            "" if r["comm_share"] is None else f"{r['comm_share']:.0%}",
        ]
        for r in d["scaling"]
    ]
    out = md(["nproc", "threads", "step ms", "spread", "samples/s", "efficiency", "comm share"], rows)
    rows = [
        [
            o["label"],
            f"{o['step_ms']:.0f}",
            f"±{o['spread'] / 2:.0%}",
            "" if o["comm_share"] is None else f"{o['comm_share']:.0%}",
        ]
        for o in d["options"]
    ]
    return out + "\n\n" + md(["at 2 ranks", "step ms", "spread", "comm share"], rows)


def _human(size: int) -> str:
    for unit, mult in (("MB", 2**20), ("KB", 2**10)):
        if size >= mult:
            return f"{size / mult:g} {unit}"
    return f"{size} B"


def main(folder: str) -> None:
    sources = (
        ("overhead", "overhead.json", overhead),
        ("peers", "peers.json", peers),
        ("collectives", "collectives/collectives.json", collectives),
        ("tune", "tune-mlp.json", tune),
        ("scaling", "scaling-gpt/scaling.json", scaling),
    )
    for title, name, fn in sources:
        data = _load(folder, name)
        if data is not None:
            print(f"### {title}\n\n{fn(data)}\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/final")
