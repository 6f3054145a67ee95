"""ddpkit next to hand-written DDP, Hugging Face Accelerate and Lightning Fabric: same workloads, one run.

    .venv-bench/bin/python benchmarks/peers.py                       # cnn, mlp, gpt; about 20 minutes
    .venv-bench/bin/python benchmarks/peers.py --workloads cnn --rounds 3 --cold-reps 2 --json runs/peers.json

Needs the development extras (`pip install -c constraints.txt -e . accelerate lightning`, kept in a
separate .venv-bench so the test environment stays clean).

Warm step time: 2 CPU ranks x 1 thread with gloo, one block of >= --block-seconds per tool, in an order
that rotates every round. ddpkit sets the ranks' CPU allocator (`ddpkit.parallel.cpu_allocator`), a setting of
the whole process, so the tools run in two pairs of processes per round: DDP, Accelerate and Fabric with
glibc's defaults, as their users get them; ddpkit, ddpkit + "shm" hook and hand-written DDP with
ddpkit's allocator settings ("DDP + kept memory": how much of ddpkit's lead is the allocator). One
process with 1 and with 2 threads (glibc defaults) runs in its own processes in the same rotation. The
ratio of two tools is taken per round (blocks minutes apart at most), then summarised as median
[min, max].

Cold start: each tool started by its own launcher, as its documentation says: torchrun for DDP,
`ddpkit run`, `fabric run`, and torchrun for Accelerate because `accelerate launch --cpu
--num_processes 2` starts ONE process (checked and reported on every run). Time to first step = wall
time from starting the command to the end of global rank 0's first step; then, as a README user meets
it (issue 20): step = median of rank 0's steps 6..35, peak memory = the largest rank's ru_maxrss over
all 35 steps. Every rank reports its world size; a run whose world size is wrong fails.

Two methods, two answers (issue 20): the warm blocks above run every tool in processes started by
`ddpkit.spawn`, not by its launcher, with ddpkit's allocator applied to the whole ddpkit group at start
(memory kept for every model, which `ddpkit run` does only for models with a 32 MiB tensor) and several
variants one after the other in the same processes; they isolate the step. The cold runs are what a user
of the README gets (`ddpkit run`, the session's own per-model allocator decision, a fresh process per
tool). benchmarks/side_by_side.py runs only the latter, with start-up read from the launcher's output.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import peers_worker as pw  # noqa: E402
import torch  # noqa: E402

import ddpkit  # noqa: E402
from ddpkit.tools import workloads  # noqa: E402

COLD = ("single", "ddp", "ddpkit", "accelerate", "fabric")
COLD_STEPS, COLD_WARMUP = 35, 5  # the README user's view: median of 30 steps after 5
DDP_VARIANTS = ("ddp", "ddpkit", "ddpkit-shm", "ddp-kept", "accelerate", "fabric")
LABELS = {
    "single1": "1 process x 1 thr",
    "single2": "1 process x 2 thr",
    "ddp": "hand-written DDP",
    "ddpkit": "ddpkit",
    "ddpkit-shm": "ddpkit + shm hook",
    "ddp-kept": "DDP + kept memory",
    "accelerate": "Accelerate",
    "fabric": "Fabric",
}
# (name, processes, threads, variants, ddpkit's allocator settings): one spawn per group and round
GROUPS = [
    ("peers", 2, 1, ["ddp", "accelerate", "fabric"], False),
    ("ddpkit", 2, 1, ["ddpkit", "ddpkit-shm", "ddp-kept"], True),
    ("single1", 1, 1, ["single"], False),
    ("single2", 1, 2, ["single"], False),
]


def rank_main(spec: str, variants: list[str], block_s: float, warmup: int, kept: bool) -> dict[str, Any]:
    """One rank: one timed block per variant, in the given order; rank 0's seconds per step."""
    if kept:
        from ddpkit.parallel import cpu_allocator

        cpu_allocator.apply()  # before any tensor; ddpkit's sessions would apply it at their start
    wl = workloads.load(spec)
    data = wl.dataset(batches=8)
    if int(os.environ["WORLD_SIZE"]) > 1:  # the job's group, made once: no tool owns (and destroys) it
        torch.distributed.init_process_group("gloo")
    out: dict[str, Any] = {}
    for variant in variants:
        loop = pw.make("ddp" if variant == "ddp-kept" else variant, wl, data)
        for _ in range(warmup):
            start = time.perf_counter()
            pw.step(wl, loop)
        steps = max(3, int(block_s / max(time.perf_counter() - start, 1e-6)) + 1)
        if torch.distributed.is_initialized():  # every rank runs the same number of steps
            n = torch.tensor(steps)
            torch.distributed.all_reduce(n, op=torch.distributed.ReduceOp.MAX)
            steps = int(n)
            torch.distributed.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            pw.step(wl, loop)
        out[variant] = {
            "step_s": (time.perf_counter() - start) / steps,
            "world": loop.world,
            "threads": torch.get_num_threads(),
        }
        loop.close()
        del loop
    return out


def warm(spec: str, rounds: int, block_s: float, log: Any) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {k: [] for k in ("single1", "single2", *DDP_VARIANTS)}
    for r in range(rounds):
        for name, nproc, threads, members, kept in GROUPS[r % 4 :] + GROUPS[: r % 4]:
            variants = members[r % len(members) :] + members[: r % len(members)]
            env = {} if kept else {"DDPKIT_CPU_ALLOCATOR": "default"}
            res = ddpkit.spawn(
                rank_main,
                nproc=nproc,
                args=(spec, variants, block_s, 2, kept),
                threads=threads,
                timeout=1800,
                env=env,
            )[0]
            for variant, m in res.items():
                key = name if variant == "single" else variant
                if m["world"] != nproc or m["threads"] != threads:
                    raise RuntimeError(
                        f"{variant}: world {m['world']} x {m['threads']} threads, "
                        f"expected {nproc} x {threads}"
                    )
                times[key].append(m["step_s"])
        last = ", ".join(f"{k} {v[-1] * 1e3:.1f}" for k, v in times.items())
        log(f"  {spec} round {r + 1}/{rounds} (ms): {last}")
    return times


def cold_command(variant: str, spec: str, steps: int) -> list[str]:
    bin_dir = os.path.dirname(sys.executable)
    script = [
        os.path.join(HERE, "peers_worker.py"),
        "--variant",
        variant,
        "--workload",
        spec,
        "--steps",
        str(steps),
    ]
    torchrun = [os.path.join(bin_dir, "torchrun"), "--standalone", "--nproc-per-node", "2"]
    return {
        "single": [sys.executable, *script],
        "ddp": [*torchrun, *script],
        "ddpkit": [os.path.join(bin_dir, "ddpkit"), "run", "--nproc", "2", *script],
        "accelerate": [*torchrun, *script],
        "accelerate-launch": [
            os.path.join(bin_dir, "accelerate"),
            "launch",
            "--cpu",
            "--num_processes",
            "2",
            *script[:2],
            "accelerate",
            *script[3:],
        ],
        "fabric": [
            os.path.join(bin_dir, "fabric"),
            "run",
            "--accelerator",
            "cpu",
            "--strategy",
            "ddp",
            "--devices",
            "2",
            *script,
        ],
    }[variant]


def cold(variant: str, spec: str, steps: int) -> dict[str, Any]:
    """Start the tool's launcher; time to rank 0's first step, peak memory and world size per rank."""
    import glob
    import tempfile

    env = {**os.environ, "OMP_NUM_THREADS": "1" if variant != "single" else "2"}
    with tempfile.TemporaryDirectory() as out:
        start = time.time()
        proc = subprocess.run(
            [*cold_command(variant, spec, steps), "--out", out],
            capture_output=True,
            text=True,
            env=env,
            timeout=900,
        )
        ranks = []
        for path in glob.glob(os.path.join(out, "rank*.json")):
            with open(path) as f:
                ranks.append(json.load(f))
    if proc.returncode or not ranks:
        tail = f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        raise RuntimeError(f"{variant} failed ({proc.returncode}):\n{tail}")
    ranks.sort(key=lambda r: r["rank"])
    ph = ranks[0]["phases"]
    phases = {
        "launcher": ph["started"] - start,
        "imports": ph["imported"] - ph["started"],
        "set_up": ph["set_up"] - ph["data"],
        "first_step": ranks[0]["first_step_done"] - ph["set_up"],
    }
    return {
        "ttfs_s": ranks[0]["first_step_done"] - start,
        "worlds": [r["world"] for r in ranks],
        "peak_rss_mb": [r["peak_rss_mb"] for r in ranks],
        "largest_rss_mb": max(r["peak_rss_mb"] for r in ranks),
        "step_ms": statistics.median(ranks[0]["step_s"][COLD_WARMUP:]) * 1e3,
        "processes": len(ranks),
        "phases": phases,
    }


def ratio(times: dict[str, list[float]], a: str, b: str) -> tuple[float, float, float]:
    r = [x / y for x, y in zip(times[a], times[b], strict=True)]
    return statistics.median(r), min(r), max(r)


def fmt_ratio(r: tuple[float, float, float]) -> str:
    return f"{r[0]:.3f} [{r[1]:.3f}, {r[2]:.3f}]"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="cnn,mlp,gpt")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--block-seconds", type=float, default=2.0)
    p.add_argument("--cold-reps", type=int, default=3)
    p.add_argument("--cold-workloads", default=None, help="default: --workloads")
    p.add_argument("--cold-variants", default=",".join(COLD), help=f"a subset of {','.join(COLD)}")
    p.add_argument("--json", default=None)
    p.add_argument("--skip-warm", action="store_true")
    p.add_argument("--skip-cold", action="store_true")
    ns = p.parse_args()
    specs = ns.workloads.split(",")
    load0 = os.getloadavg()
    cores = len(os.sched_getaffinity(0))
    print(f"peers: torch {torch.__version__}, load average {load0[0]:.2f}, {cores} cores", flush=True)
    from ddpkit.bench.report import cpu_steal

    result: dict[str, Any] = {"load_start": load0, "warm": {}, "cold": {}, "steal_start": cpu_steal()}
    for spec in [] if ns.skip_warm else specs:
        result["warm"][spec] = warm(spec, ns.rounds, ns.block_seconds, lambda m: print(m, flush=True))
        save(ns.json, result)
    if ns.skip_cold:
        result["load_end"] = os.getloadavg()
        save(ns.json, result)
        print_tables(result)
        return 0
    variants = [v for v in COLD if v in ns.cold_variants.split(",")]
    if "accelerate" in variants:
        check = cold("accelerate-launch", "cnn", 1)
        result["accelerate_launch_processes"] = check["processes"]
        print(
            f"`accelerate launch --cpu --num_processes 2` started {check['processes']} process(es), world "
            f"size {check['worlds']}; Accelerate's cold start is measured under torchrun",
            flush=True,
        )
    for spec in (ns.cold_workloads or ns.workloads).split(","):
        runs: dict[str, list[dict]] = {v: [] for v in variants}
        for rep in range(ns.cold_reps):
            order = variants[rep % len(variants) :] + variants[: rep % len(variants)]
            for variant in order:
                r = cold(variant, spec, COLD_STEPS)
                want = 1 if variant == "single" else 2
                if r["worlds"] != [want] * want:
                    raise RuntimeError(f"{variant} ran with world sizes {r['worlds']}, expected {want}")
                runs[variant].append(r)
        result["cold"][spec] = runs
        save(ns.json, result)
        print(
            f"  cold {spec}: "
            + ", ".join(f"{v} {statistics.median(x['ttfs_s'] for x in rs):.2f} s" for v, rs in runs.items()),
            flush=True,
        )
    result["load_end"] = os.getloadavg()
    save(ns.json, result)
    print_tables(result)
    if ns.json:
        print(f"json: {ns.json}")
    return 0


def save(path: str | None, result: dict[str, Any]) -> None:
    """Write what has been measured so far (a later failure does not lose it)."""
    if path:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def print_tables(result: dict[str, Any]) -> None:
    from ddpkit.bench.report import table

    keys = ["single1", "single2", *DDP_VARIANTS]
    rows = []
    for spec, t in result["warm"].items():
        rows.append([spec] + [f"{statistics.median(t[k]) * 1e3:.1f} ±{_half_spread(t[k]):.0%}" for k in keys])
    print("\nstep time, ms: median over rounds ±half the spread (max-min)/median")
    print(table(["workload"] + [LABELS[k] for k in keys], rows))
    rows = []
    for spec, t in result["warm"].items():
        rows.append(
            [
                spec,
                fmt_ratio(ratio(t, "ddpkit", "ddp")),
                fmt_ratio(ratio(t, "ddpkit", "accelerate")),
                fmt_ratio(ratio(t, "ddpkit", "fabric")),
                fmt_ratio(ratio(t, "ddpkit-shm", "ddp")),
                fmt_ratio(ratio(t, "ddpkit", "ddp-kept")),
            ]
        )
    print("\nstep-time ratios, per round, median [min, max] (below 1: the first is faster)")
    print(
        table(
            [
                "workload",
                "ddpkit / DDP",
                "ddpkit / Accelerate",
                "ddpkit / Fabric",
                "ddpkit+shm / DDP",
                "ddpkit / (DDP + kept memory)",
            ],
            rows,
        )
    )
    cold_labels = {
        "single": "python (1 proc)",
        "ddp": "torchrun + DDP",
        "ddpkit": "ddpkit run",
        "accelerate": "torchrun + Accelerate",
        "fabric": "fabric run",
    }
    for spec, runs in result["cold"].items():
        rows = []
        for v, rs in runs.items():
            ttfs = [r["ttfs_s"] for r in rs]
            mem = [r.get("largest_rss_mb", max(r["peak_rss_mb"])) for r in rs]
            steps = [r["step_ms"] for r in rs if "step_ms" in r]
            med = statistics.median(ttfs)
            row: list[Any] = [cold_labels[v], f"{med:.2f} s [{min(ttfs):.2f}, {max(ttfs):.2f}]"]
            row.append(f"{statistics.median(steps):.1f} ms" if steps else "")
            row.append(f"{statistics.median(mem):.0f} MB [{min(mem):.0f}, {max(mem):.0f}]")
            for phase in ("launcher", "imports", "set_up", "first_step"):
                row.append(f"{statistics.median(r['phases'][phase] for r in rs):.2f}")
            rows.append(row)
        print(
            f"\ncold start, {spec}: command to rank 0's first finished step, median [min, max] of "
            f"{len(rs)}; step = median of steps 6..35; peak RSS of the largest rank; phases of rank 0 "
            "(medians, s)"
        )
        headers = ["tool", "first step", "step", "peak RSS", "launcher", "imports", "set-up", "first step"]
        print(table(headers, rows))
    from ddpkit.bench.report import cpu_steal, load_note

    print(
        load_note(
            result["load_start"],
            result["load_end"],
            len(os.sched_getaffinity(0)),
            (result.get("steal_start"), cpu_steal()),
        )
    )


def _half_spread(samples: list[float]) -> float:
    return (max(samples) - min(samples)) / statistics.median(samples) / 2


if __name__ == "__main__":
    sys.exit(main())
