"""`ddpkit bench scaling`: how a workload's throughput grows with processes, and where the time goes.

    ddpkit bench scaling --workload gpt                    # nproc 1..cores, 1 thread per rank
    ddpkit bench scaling --workload mypkg.models:wl --max-nproc 4 --out runs/scaling

Strong scaling: the global batch stays the workload's, split over the ranks. Scaling efficiency at n
ranks is T(1) / (n x T(n)) with T the step time (1.00 is ideal). The communication share is what the
all-reduce adds to a step: 1 - (step time under no_sync) / (step time). At the largest process count it
also sweeps DDP's bucket size and compares communication hooks (lossy ones are labelled). Writes a
table, `scaling.json` and `scaling.png` under --out.
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any

from ddpkit.bench import report
from ddpkit.bench.runner import LOSSY_HOOKS, Config, Stats, measure
from ddpkit.data import plan_batch
from ddpkit.errors import DdpkitError
from ddpkit.tools import workloads
from ddpkit.tools.plotting import pyplot


def plan(
    workload: workloads.Workload,
    max_nproc: int,
    threads: int,
    cores: int,
    buckets: list[float],
    hooks: list[str],
) -> tuple[list[Config], list[str]]:
    """Configs for the scaling curve, the bucket sweep and the hook comparison; notes on skipped n."""
    notes = []
    configs = []
    counts = []
    for n in range(1, max_nproc + 1):
        try:
            plan_batch(workload.global_batch, None, world_size=n)  # the loader's split, or its refusal
        except DdpkitError:
            notes.append(f"nproc {n} skipped: global batch {workload.global_batch} is not divisible by it")
            continue
        counts.append(n)
        configs.append(
            Config(
                label=f"nproc {n}",
                nproc=n,
                threads=threads,
                gradient_as_bucket_view=True,
                cpu_allocator=True,
                shard=n > 1,
            )
        )
    top = counts[-1]
    if top > 1:
        for mb in buckets:
            if mb != 25:
                configs.append(
                    Config(
                        label=f"bucket {mb:g} MB",
                        nproc=top,
                        threads=threads,
                        gradient_as_bucket_view=True,
                        bucket_cap_mb=mb,
                        cpu_allocator=True,
                        shard=True,
                    )
                )
        for hook in hooks:
            if hook != "allreduce":
                configs.append(
                    Config(
                        label=f"hook {hook}",
                        nproc=top,
                        threads=threads,
                        gradient_as_bucket_view=True,
                        hook=hook,
                        cpu_allocator=True,
                        shard=True,
                    )
                )
    if cores > threads:
        configs.append(
            Config(label=f"1 process x {cores} threads", nproc=1, threads=cores, cpu_allocator=True)
        )
    return configs, notes


def run(ns: argparse.Namespace) -> int:
    workload = workloads.load(ns.workload)
    cores = report.machine()["cores"]
    max_nproc = ns.max_nproc or cores
    buckets = [float(b) for b in ns.buckets.split(",") if b]
    hooks = [h for h in ns.hooks.split(",") if h]
    configs, notes = plan(workload, max_nproc, ns.threads, cores, buckets, hooks)
    for note in notes:
        print(f"ddpkit bench scaling: {note}")
    if ns.threads * max_nproc > cores:
        print(
            f"ddpkit bench scaling: note: {max_nproc} x {ns.threads} threads exceeds {cores} cores; the "
            "largest counts oversubscribe the CPU and will not scale"
        )
    before, steal0 = report.machine()["load_average"], report.cpu_steal()
    print(
        f"ddpkit bench scaling: workload {workload.name}, global batch {workload.global_batch}, "
        f"{len(configs)} configurations x {ns.rounds} rounds x >= {ns.block_seconds:g} s",
        flush=True,
    )
    stats = measure(
        ns.workload,
        configs,
        rounds=ns.rounds,
        steps=ns.steps,
        warmup=ns.warmup,
        target_s=ns.block_seconds,
        no_sync=True,
        log=print if ns.verbose else None,
    )
    after, steal1 = report.machine()["load_average"], report.cpu_steal()
    data = summarise(workload, configs, stats)
    data.update(machine=report.machine(), load_before=before, load_after=after, notes=notes)
    print_tables(data)
    note = report.load_note(before, after, cores, (steal0, steal1))
    if note:
        print(note)
    os.makedirs(ns.out, exist_ok=True)
    print(f"json: {report.write_json(os.path.join(ns.out, 'scaling.json'), data)}")
    print(f"plot: {plot(data, os.path.join(ns.out, 'scaling.png'))}")
    return 0


def summarise(workload: workloads.Workload, configs: list[Config], stats: dict[str, Stats]) -> dict[str, Any]:
    curve = [c for c in configs if c.label.startswith("nproc ")]
    t1 = stats[curve[0].label].median
    rows = []
    for c in curve:
        st = stats[c.label]
        # The same steps without any all-reduce (no_sync): ranks run independently, so this efficiency
        # is what the machine allows (shared memory bandwidth, the optimizer step every rank repeats)
        # before communication costs anything.
        alone = statistics.median(st.no_sync) if st.no_sync else None
        rows.append(
            {
                "nproc": c.nproc,
                "threads": c.threads,
                "step_ms": st.median * 1e3,
                "spread": st.spread,
                "samples_per_s": workload.global_batch / st.median,
                "speedup": t1 / st.median,
                "efficiency": t1 / (c.nproc * st.median),
                "comm_share": st.comm_share,
                "efficiency_without_comm": t1 / (c.nproc * alone) if alone else None,
            }
        )
    others = []
    for c in configs:
        if c in curve:
            continue
        st = stats[c.label]
        others.append(
            {
                "label": c.label,
                "step_ms": st.median * 1e3,
                "spread": st.spread,
                "samples_per_s": workload.global_batch / st.median,
                "comm_share": st.comm_share,
                "lossy": c.hook in LOSSY_HOOKS,
                "settings": c.describe(),
            }
        )
    top = curve[-1]
    others.insert(
        0,
        {
            "label": "ddpkit defaults (bucket 25 MB, allreduce, sharded step)",
            "step_ms": stats[top.label].median * 1e3,
            "spread": stats[top.label].spread,
            "samples_per_s": workload.global_batch / stats[top.label].median,
            "comm_share": stats[top.label].comm_share,
            "lossy": False,
            "settings": top.describe(),
        },
    )
    return {
        "workload": workload.name,
        "global_batch": workload.global_batch,
        "scaling": rows,
        "options": others,
    }


def _pct(v: float | None) -> str:
    return "" if v is None else f"{v:.0%}"


def print_tables(data: dict[str, Any]) -> None:
    rows = [
        [
            r["nproc"],
            r["threads"],
            r["step_ms"],
            f"±{r['spread'] / 2:.0%}",
            r["samples_per_s"],
            r["speedup"],
            r["efficiency"],
            _pct(r["comm_share"]),
            "" if r.get("efficiency_without_comm") is None else f"{r['efficiency_without_comm']:.3f}",
        ]
        for r in data["scaling"]
    ]
    print(
        report.table(
            [
                "nproc",
                "threads",
                "step ms",
                "spread",
                "samples/s",
                "speed-up",
                "efficiency",
                "comm share",
                "efficiency without comm",
            ],
            rows,
        )
    )
    print(
        "(efficiency without comm: the same steps with no all-reduce, ranks running independently --\n"
        " the ceiling this machine sets before any communication, from memory bandwidth shared by the\n"
        " ranks and the optimizer step each rank repeats)"
    )
    print()
    rows = [
        [
            o["label"] + (" (lossy)" if o["lossy"] else ""),
            o["step_ms"],
            f"±{o['spread'] / 2:.0%}",
            o["samples_per_s"],
            _pct(o["comm_share"]),
        ]
        for o in data["options"]
    ]
    print(report.table(["at the largest nproc", "step ms", "spread", "samples/s", "comm share"], rows))


def plot(data: dict[str, Any], path: str) -> str:
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4), dpi=110)
    n = [r["nproc"] for r in data["scaling"]]
    thr = [r["samples_per_s"] for r in data["scaling"]]
    a.plot(n, thr, "o-", label="measured", color="#3366cc")
    a.plot(n, [thr[0] * k for k in n], "--", color="#999999", label="ideal (linear)")
    ceiling = [r.get("efficiency_without_comm") or 1.0 for r in data["scaling"]]
    a.plot(
        n,
        [thr[0] * k * e for k, e in zip(n, ceiling, strict=True)],
        ":",
        color="#339966",
        label="without communication",
    )
    for k, t, r in zip(n, thr, data["scaling"], strict=True):
        a.annotate(f"{r['efficiency']:.2f}", (k, t), textcoords="offset points", xytext=(4, -12), fontsize=8)
    a.set(
        xlabel="processes (ranks)",
        ylabel="samples / s",
        xticks=n,
        title=f"{data['workload']}: throughput (labels: efficiency)",
    )
    a.legend()
    opts = data["options"]
    labels = [o["label"].replace(" (bucket", "\n(bucket") for o in opts]
    colors = ["#cc6633" if o["lossy"] else "#3366cc" for o in opts]
    b.barh(range(len(opts)), [o["samples_per_s"] for o in opts], color=colors)
    b.set_yticks(range(len(opts)), labels, fontsize=8)
    b.invert_yaxis()
    b.set(xlabel="samples / s", title=f"at {n[-1]} ranks: buckets, hooks (orange: lossy)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", default="gpt", help="cnn, mlp, gpt, or package.module:function")
    p.add_argument("--max-nproc", type=int, default=None, help="largest process count (default: cores)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per rank")
    p.add_argument("--buckets", default="1,5,25,100", help="bucket sizes (MB) swept at the largest nproc")
    p.add_argument("--hooks", default="allreduce,shm,fp16", help="hooks compared at the largest nproc")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="at least this many timed steps per block")
    p.add_argument("--block-seconds", type=float, default=1.0, help="at least this long per timed block")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default="runs/bench-scaling", help="folder for scaling.json and scaling.png")
    p.add_argument("-v", "--verbose", action="store_true")
