"""`ddpkit plan`: predicted step time, throughput and efficiency at N = 1, 2, 4, ... devices.

    ddpkit plan --workload gpt --max-gpus 256 --link ib-ndr --plot plan.png
    ddpkit plan --workload mypkg.models:my_workload --max-gpus 64 --link eth-100g --json plan.json
    ddpkit plan --workload mlp --counts 1,2,3,4 --global-batch 48 --link measured   # this machine's ranks
    ddpkit plan --list-links
    ddpkit plan --memory --model hf:gpt2 --device h100 --world 8 --global-batch 512   # will it fit?
    ddpkit plan --workload gpt --max-gpus 16384 --fault-rate 2e-5 --restart-s 600    # faults at scale
    ddpkit plan --workload mypkg.models:gpt --strategy tp --tensor-degree 8 --tp-plan mypkg.models:TP_PLAN \\
        --max-gpus 64 --link ib-ndr                                                   # TP x FSDP

The model is profiled on one device (this machine's CPU unless --device cuda): forward, backward, the
time each DDP bucket's gradients are ready, the optimizer step. The step on N devices is then
simulated over the link (ddpkit/plan/simulate.py states the cost model), and the expected training time
lost to faults at each N, with disk checkpoints only and with memory snapshots (ddpkit/plan/faults.py).
Weak scaling by default: each device keeps the per-rank batch (--batch-size, default the workload's
batch); --global-batch G splits G over the devices instead. A CPU profile says nothing about a GPU's
speed: plan for GPUs by profiling on one (--device cuda), or say how much faster the target is
(--compute-scale).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from ddpkit.errors import DdpkitError, problem


def build_parser() -> argparse.ArgumentParser:
    from ddpkit import strategy as strategies
    from ddpkit.plan import faults, tp_time
    from ddpkit.plan.links import LEVELS
    from ddpkit.plan.simulate import ALGORITHMS, HOOKS

    p = argparse.ArgumentParser(prog="ddpkit plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="gpt", help="cnn, mlp, gpt, or package.module:function (a Workload)")
    p.add_argument("--model", default=None, help="alias of --workload for a package.module:function")
    p.add_argument("--max-gpus", type=int, default=8, help="largest N; the plan shows 1, 2, 4, ... up to it")
    p.add_argument("--counts", default=None, help="explicit N values, comma-separated (e.g. 1,2,3,4)")
    p.add_argument(
        "--link", default="ib-ndr", help="a preset (--list-links), measured, or measured:FILE.json"
    )
    p.add_argument("--intra", choices=sorted(LEVELS), default=None, help="override the intra-node level")
    p.add_argument("--nics-per-node", type=int, default=None, help="override the preset's NICs per node")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--algorithm", choices=ALGORITHMS, default="auto", help="all-reduce algorithm assumed")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--hook", choices=HOOKS, default="none")
    p.add_argument("--powersgd-rank", type=int, default=1)
    p.add_argument("--strategy", choices=strategies.distributed(), default="ddp")  # every registered one
    p.add_argument("--accumulation", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=None, help="per-rank batch (weak scaling)")
    p.add_argument("--global-batch", type=int, default=None, help="split over N (strong scaling)")
    p.add_argument(
        "--sharded-step",
        choices=("auto", "on", "off"),
        default="auto",
        help="ddpkit's sharded optimizer step (auto: on for CPU ranks of one machine)",
    )
    p.add_argument(
        "--contention",
        choices=("measured", "formula"),
        default="measured",
        help="CPU ranks on this machine: profile n ranks computing at once (measured), or assume compute "
        "slows by max(1, ranks x threads / cores) (formula)",
    )
    p.add_argument("--device", choices=("cpu", "cuda", "auto"), default="cpu", help="device to profile on")
    p.add_argument(
        "--threads", type=int, default=None, help="CPU threads for the profile (default: as a rank)"
    )
    p.add_argument("--compute-scale", type=float, default=1.0, help="target device is X times faster")
    p.add_argument("--device-memory", type=float, default=80.0, help="GB per device, for the memory advice")
    p.add_argument("--steps", type=int, default=6, help="timed profile steps")
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="profile this many times in fresh processes; predict from the median",
    )
    p.add_argument("--profile", default=None, help="reuse the profiles of an earlier plan's JSON")
    p.add_argument("--json", default=None, metavar="PATH", help="write the plan as JSON ('-': stdout only)")
    p.add_argument("--plot", default=None, metavar="PATH", help="write a PNG of efficiency vs N")
    p.add_argument("--list-links", action="store_true", help="print the link presets and their sources")
    p.add_argument(
        "--memory",
        action="store_true",
        help="the peak memory per rank of one step, and the largest micro-batch that fits: "
        "`ddpkit plan --memory --help` (ddpkit.plan.memory_cli)",
    )
    faults.add_arguments(p)
    tp_time.add_arguments(p)
    return p


def list_links() -> str:
    from ddpkit.plan.links import PRESETS, preset

    lines = []
    for name, (_, _, _, what) in PRESETS.items():
        lines.append(f"{name}: {what}")
        lines += [f"    {line}" for line in preset(name).describe()]
    lines.append(
        "measured[:collectives.json]: α and β fitted to `ddpkit bench collectives` on this machine's ranks"
    )
    return "\n".join(lines)


def make_plan(ns: argparse.Namespace) -> dict[str, Any]:
    from ddpkit import strategy as strategies
    from ddpkit.bench.report import machine
    from ddpkit.plan import advice, faults, links, planner, profile, tp_time
    from ddpkit.plan.simulate import Options
    from ddpkit.tools import workloads

    spec = ns.model or ns.workload
    counts = [int(c) for c in ns.counts.split(",") if c] if ns.counts else planner.counts_up_to(ns.max_gpus)
    if not counts or min(counts) < 1:
        raise problem(f"device counts {counts} are not all 1 or more", "Pass --max-gpus N or --counts 1,2,4")
    counts = sorted(set([1, *counts]))
    tensor, counts = tp_time.options(ns, spec, counts, ns.gpus_per_node)
    measured = ns.link.startswith("measured")
    cores = machine()["cores"]
    threads = ns.threads or (1 if measured else cores)
    strong = ns.global_batch is not None
    wl = workloads.load(spec)
    batches = planner.per_rank_batches(
        counts,
        batch=ns.batch_size or wl.global_batch,
        global_batch=ns.global_batch,
        tensor=tensor.get("tensor", 1),
    )
    link = links.load(ns.link, counts=counts, threads=threads, intra=ns.intra, nics_per_node=ns.nics_per_node)
    beside: dict[int, profile.Profile] = {}
    if ns.profile:
        with open(ns.profile) as f:
            saved = json.load(f)
        profiles = {int(b): profile.Profile.from_dict(d) for b, d in saved["profiles"].items()}
        if ns.contention == "measured":
            beside = {int(n): profile.Profile.from_dict(d) for n, d in saved.get("beside", {}).items()}
    else:
        _check_device(ns.device)
        wanted = planner.batches_to_profile(list(batches.values()))
        profiles = profile.measure(
            spec, wanted, threads=threads, device=ns.device, steps=ns.steps, repeats=ns.repeats
        )
        if link.shares_cores and ns.contention == "measured":
            for n in (c for c in counts if c > 1):
                got = profile.measure(
                    spec, [batches[n]], ranks=n, threads=threads, steps=ns.steps, repeats=ns.repeats
                )
                beside[n] = got[batches[n]]
    per_node = ns.gpus_per_node
    if measured:  # one machine's ranks; or two measured hosts, a node being the ranks measured together
        per_node = max(counts) if link.inter is None else min(link.intra.fits)
    sharded = ns.sharded_step == "on" or (ns.sharded_step == "auto" and link.shares_cores)
    opts = Options(
        bucket_cap_mb=ns.bucket_cap_mb,
        hook=ns.hook,
        powersgd_rank=ns.powersgd_rank,
        strategy=ns.strategy,
        accumulation=ns.accumulation,
        sharded_step=sharded,
        dims=strategies.entry(ns.strategy).dims,  # its layout's degrees (a registered one's too)
        **tensor,
    )
    pl = planner.Planner(
        profiles=profiles,
        link=link,
        per_node=per_node,
        algorithm=ns.algorithm,
        compute_scale=ns.compute_scale,
        batches=batches,
        beside=beside,
    )
    curve = pl.curve(counts, opts)
    top = curve[-1]
    band = pl.band(counts, opts)
    rows = [
        {
            **q.as_dict(),
            "nodes": pl.cluster(q.n).nodes,
            "step_band_s": w["step_s"],
            "efficiency_band": w["efficiency"],
        }
        for q, w in zip(curve, band, strict=True)
    ]
    plan: dict[str, Any] = {
        "workload": wl.name,
        "link_name": link.name,
        "link": link.describe(),
        "scaling": (
            f"strong scaling: global batch {ns.global_batch} split over N"
            if strong
            else f"weak scaling: {batches[1]} samples per device"
        ),
        "profiled_on": _profiled_on(profiles, ns.compute_scale),
        "counts": counts,
        "repeats": ns.repeats,
        "curve": rows,
        "options": opts.as_dict(),
        **({"tensor": tp_time.section(opts)} if tensor else {}),
        "machine": machine(),
        "profiles": {str(b): p.as_dict() for b, p in profiles.items()},
        "beside": {str(n): p.as_dict() for n, p in beside.items()},
    }
    if top.n > 1:
        base_opts = replace(opts, hook="none")
        plan["buckets"] = [q.as_dict() for q in pl.bucket_sweep(top.n, base_opts)]
        plan["best_bucket_mb"] = pl.best_bucket(top.n, base_opts).options["bucket_cap_mb"]
        plan["hooks"] = [pl.predict(top.n, base_opts).as_dict()] + [
            q.as_dict() for q in pl.hook_sweep(top.n, base_opts)
        ]
        plan["hook_verdict"] = _hook_verdict(plan["hooks"])
    plan["advice"] = advice.advise(
        pl, top.n, opts, top, strong=strong, device_memory_gb=None if measured else ns.device_memory
    )
    param_bytes = next(iter(profiles.values())).param_bytes  # the fp32 weights
    plan["faults"] = faults.section(rows, param_bytes, ns, per_node)
    plan["fault_options"] = {k: getattr(ns, k) for k in faults.OPTIONS}
    plan["assumptions"] = _assumptions(link, profiles, ns, bool(beside))
    return plan


def _check_device(device: str) -> None:
    """Refuse --device cuda on a machine without a GPU before any rank starts: the profile's ranks would
    each fail with a traceback, and the plan would end with a spawn error instead of this paragraph."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise problem(
            "--device cuda was asked for, but this machine has no visible GPU to profile on",
            "Profile on this CPU (--device cpu) and say how much faster the target is (--compute-scale), "
            "or run the plan on a machine with the GPU (check CUDA_VISIBLE_DEVICES and the driver)",
        )


def _profiled_on(profiles: dict[int, Any], scale: float) -> str:
    p = next(iter(profiles.values()))
    text = f"{p.device} ({p.threads} thread(s)), batch(es) {sorted(profiles)}"
    return text + (f", compute divided by {scale:g} for the target device" if scale != 1.0 else "")


def _hook_verdict(rows: list[dict[str, Any]]) -> str:
    plain = rows[0]
    best = min(rows[1:], key=lambda r: r["step_s"])
    gain = plain["step_s"] / best["step_s"] - 1
    name = best["options"]["hook"] + (
        f" rank {best['options']['powersgd_rank']}" if best["options"]["hook"] == "powersgd" else ""
    )
    if gain < 0.02:
        return f"no hook pays: the best ({name}) is predicted {gain:+.1%} against the plain fp32 all-reduce"
    return f"{name} is predicted {gain:+.0%} faster than the plain all-reduce (lossy: see the advice)"


def _assumptions(link: Any, profiles: dict[int, Any], ns: argparse.Namespace, beside: bool) -> list[str]:
    out = [
        "every rank computes as fast as the profiled device, with no jitter and no straggler: a real job "
        "waits for its slowest rank at every all-reduce",
        "the links run at the stated rate with no congestion from other jobs; NCCL's protocol choice "
        "(LL, LL128, Simple), channel count and SHARP are summarised by one α and β per level",
        "one communication stream; a bucket's all-reduce starts when its last gradient is ready and "
        "after the previous bucket's; the optimizer step waits for all of them",
        "PowerSGD's and the casts' own compute is not counted; FSDP's is approximated by DDP's buckets",
    ]
    p = next(iter(profiles.values()))
    if p.device == "cpu" and not link.shares_cores and ns.compute_scale == 1.0:
        out.insert(
            0,
            "compute times are this machine's CPU's: a GPU computes far faster, so communication "
            "matters more there than this plan shows; profile on the GPU (--device cuda) or pass "
            "--compute-scale",
        )
    if link.shares_cores:
        compute = (
            "per-rank compute is profiled with n ranks computing at once (shared cores, memory bandwidth), "
            "and each step waits for the slowest of them"
            if beside
            else "per-rank compute slows by max(1, ranks x threads / cores)"
        )
        out.insert(
            0,
            f"CPU ranks on this machine share its {link.cores} cores: {compute}; with no core left over, "
            "communication is added to compute instead of overlapping it",
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--memory" in args:  # its own options (ddpkit.plan.memory_cli): a model, a device, a batch
        from ddpkit.plan import memory_cli

        return memory_cli.main(args)
    ns = build_parser().parse_args(args)
    if ns.list_links:
        print(list_links())
        return 0
    try:
        from ddpkit.plan import report

        plan = make_plan(ns)
        if ns.json != "-":
            print(report.text(plan))
        if ns.json:
            report.write_json(plan, ns.json)
            if ns.json != "-":
                print(f"json: {ns.json}")
        if ns.plot:
            os.makedirs(os.path.dirname(os.path.abspath(ns.plot)), exist_ok=True)
            print(f"plot: {report.plot(plan, ns.plot)}")
    except DdpkitError as err:
        print(f"ddpkit plan: error: {err}", file=sys.stderr)
        return 2
    return 0
