"""ddpkit next to hand-written DDP (and Accelerate, Fabric where installed), measured as a user meets them.

    .venv/bin/python benchmarks/side_by_side.py                          # all workloads, 3 repetitions
    .venv/bin/python benchmarks/side_by_side.py --workloads cnn,bn --reps 5 --json runs/sbs.json
    .venv-bench/bin/python benchmarks/side_by_side.py --tools ddp,ddpkit,ddpkit-plain,accelerate,fabric

Run it before a change lands (a few minutes per workload on 2 cores): it is a benchmark, not a test.

What one measurement is: each tool started by its own launcher, as its documentation shows (torchrun +
hand-written DDP; `ddpkit run` with the README's loop `s.model` / `s.loader` / `s.backward` / `s.step`;
torchrun + Accelerate, whose `accelerate launch --cpu` starts one process; `fabric run`), 2 ranks x 1
thread, gloo, the same workload, data and batch (benchmarks/peers_worker.py). Per run:

- start-up: command launched -> rank 0's line after its first finished step, read from the launcher's
  output by this process (so the launcher's own start is in it, as a user waits for it);
- step: the median of rank 0's steps 6..35 (30 steps after 5 warm-up);
- peak RSS: the largest worker's ru_maxrss over all 35 steps.

Repetitions are interleaved: repetition r runs every tool once, in an order rotated by r, so slow
phases of a loaded machine hit every tool alike. Ratios (tool / hand-written DDP) are taken within a
repetition and summarised as median [min, max] over repetitions. Counts that do not depend on the load
(peak RSS) hold up under other jobs; step and start-up ratios are provisional on a busy machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from ddpkit.bench.report import cpu_steal, load_note, table  # noqa: E402

WORKER = os.path.join(HERE, "peers_worker.py")
MARK = "PEERS_FIRST_STEP_DONE"  # peers_worker.FIRST_STEP_MARK (not imported: that would import torch)
TOOLS = ("ddp", "ddpkit", "accelerate", "fabric")
LABELS = {
    "ddp": "torchrun + DDP",
    "ddpkit": "ddpkit run",
    "accelerate": "torchrun + Accelerate",
    "fabric": "fabric run",
    "ddpkit-plain": "ddpkit run, plain loop",
}
NEEDS = {"accelerate": "accelerate", "fabric": "lightning"}
STEPS, WARMUP = 35, 5


def command(tool: str, workload: str, out: str) -> list[str]:
    """The tool's own launcher with the worker script, 2 ranks."""
    bin_dir = os.path.dirname(sys.executable)
    script = [WORKER, "--variant", tool, "--workload", workload, "--steps", str(STEPS), "--out", out]
    torchrun = [os.path.join(bin_dir, "torchrun"), "--standalone", "--nproc-per-node", "2"]
    if tool in ("ddp", "accelerate"):
        return [*torchrun, *script]
    if tool in ("ddpkit", "ddpkit-plain"):
        return [os.path.join(bin_dir, "ddpkit"), "run", "--nproc", "2", *script]
    if tool == "fabric":
        return [
            os.path.join(bin_dir, "fabric"),
            "run",
            "--accelerator",
            "cpu",
            "--strategy",
            "ddp",
            "--devices",
            "2",
            *script,
        ]
    raise ValueError(f"unknown tool {tool!r}; choose from {TOOLS}")


def run_once(tool: str, workload: str) -> dict[str, Any]:
    """One launch: start-up seen from here, rank 0's steps, every rank's peak RSS."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as out:
        seen: list[float] = []
        lines: list[str] = []
        start, wall0 = time.perf_counter(), time.time()
        proc = subprocess.Popen(
            command(tool, workload, out), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                if MARK in line and not seen:
                    seen.append(time.perf_counter())
                lines.append(line)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            code = proc.wait(timeout=900)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        reader.join(10)
        ranks = []
        for r in range(2):
            path = os.path.join(out, f"rank{r}.json")
            if os.path.exists(path):
                with open(path) as f:
                    ranks.append(json.load(f))
    if code or len(ranks) != 2 or not seen:
        raise RuntimeError(f"{tool} on {workload} failed (exit code {code}):\n{''.join(lines[-40:])}")
    if [r["world"] for r in ranks] != [2, 2]:
        raise RuntimeError(f"{tool} ran with world sizes {[r['world'] for r in ranks]}, expected [2, 2]")
    steps = ranks[0]["step_s"][WARMUP:STEPS]
    return {
        "startup_s": seen[0] - start,
        "step_ms": statistics.median(steps) * 1e3,
        "peak_rss_mb": max(r["peak_rss_mb"] for r in ranks),
        "rss_per_rank_mb": [r["peak_rss_mb"] for r in ranks],
        "threads": [r["threads"] for r in ranks],
        "phases": [phases(r, wall0) for r in ranks],
    }


def phases(rank: dict[str, Any], wall0: float) -> dict[str, float]:
    """A rank's seconds: launcher (command -> script's first line), imports, data, set-up, first step."""
    ph = rank["phases"]
    return {
        "launcher": ph["started"] - wall0,
        "imports": ph["imported"] - ph["started"],
        "data": ph["data"] - ph["imported"],
        "set_up": ph["set_up"] - ph["data"],
        "first_step": rank["first_step_done"] - ph["set_up"],
        **{f"{k}_at": ph[k] - wall0 for k in ("group", "build", "model") if k in ph},
    }


def available(tools: list[str]) -> tuple[list[str], list[str]]:
    """The tools whose package is importable here, and those skipped."""
    here = [t for t in tools if t not in NEEDS or importlib.util.find_spec(NEEDS[t]) is not None]
    return here, [t for t in tools if t not in here]


def measure(workloads: list[str], tools: list[str], reps: int, log: Any) -> dict[str, Any]:
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for wl in workloads:
        runs[wl] = {t: [] for t in tools}
        for rep in range(reps):
            order = tools[rep % len(tools) :] + tools[: rep % len(tools)]
            for tool in order:
                r = run_once(tool, wl)
                runs[wl][tool].append(r)
                log(
                    f"  {wl} rep {rep + 1}/{reps} {tool}: start-up {r['startup_s']:.2f} s, step "
                    f"{r['step_ms']:.1f} ms, peak RSS {r['peak_rss_mb']:.0f} MB"
                )
    return runs


def summary(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def ratio_cell(a: list[float], b: list[float]) -> str:
    """Per-repetition ratios a/b as a change: median [min, max] in percent."""
    med, lo, hi = summary([x / y for x, y in zip(a, b, strict=True)])
    return f"{med - 1:+.1%} [{lo - 1:+.1%}, {hi - 1:+.1%}]"


def tables(runs: dict[str, Any], base: str = "ddp") -> str:
    out = []
    for what, key, unit, fmt in (
        ("step (median of 30 after 5 warm-up)", "step_ms", "ms", "{:.1f}"),
        ("start-up (command -> first step done, seen from outside)", "startup_s", "s", "{:.2f}"),
        ("peak RSS of the largest worker", "peak_rss_mb", "MB", "{:.0f}"),
    ):
        headers = ["workload"]
        rows = []
        for wl, by_tool in runs.items():
            row = [wl]
            tools = list(by_tool)
            for t in tools:
                vals = [r[key] for r in by_tool[t]]
                med, lo, hi = summary(vals)
                row.append(f"{fmt.format(med)} [{fmt.format(lo)}, {fmt.format(hi)}]")
            for t in tools:
                if t != base:
                    row.append(ratio_cell([r[key] for r in by_tool[t]], [r[key] for r in by_tool[base]]))
            rows.append(row)
            headers = [
                "workload",
                *(f"{LABELS[t]}, {unit}" for t in tools),
                *(f"{t} vs DDP" for t in tools if t != base),
            ]
        out.append(f"\n{what}: median [min, max] over repetitions; change vs DDP per repetition")
        out.append(table(headers, rows))
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="cnn,bn,small,mlp,gpt")
    p.add_argument(
        "--tools",
        default="ddp,ddpkit,ddpkit-plain,accelerate,fabric",
        help="ddp, ddpkit, ddpkit-plain (README's plain loop), accelerate, fabric",
    )
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", default=None)
    ns = p.parse_args()
    tools, skipped = available(ns.tools.split(","))
    if "ddp" not in tools:
        tools.insert(0, "ddp")
    cores = len(os.sched_getaffinity(0))
    load0, steal0 = os.getloadavg(), cpu_steal()
    print(
        f"side_by_side: {', '.join(tools)}"
        + (f" (not installed: {', '.join(skipped)})" if skipped else "")
        + f"; load average {load0[0]:.2f}, {cores} cores",
        flush=True,
    )
    runs = measure(ns.workloads.split(","), tools, ns.reps, lambda m: print(m, flush=True))
    load1 = os.getloadavg()
    print(tables(runs))
    print(load_note(load0, load1, cores, (steal0, cpu_steal())))
    if ns.json:
        os.makedirs(os.path.dirname(ns.json) or ".", exist_ok=True)
        with open(ns.json, "w") as f:
            json.dump({"runs": runs, "load_start": load0, "load_end": load1, "skipped": skipped}, f, indent=1)
        print(f"json: {ns.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
