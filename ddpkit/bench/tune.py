"""`ddpkit bench tune`: try the ways to train the user's model on this machine; recommend the fastest.

    ddpkit bench tune --workload mlp
    ddpkit bench tune --workload mypkg.models:my_workload --nproc 2 --rounds 5

Tried, each against hand-written DDP with torch's defaults (the baseline, ratio 1.00):
- ddpkit's defaults (gradients as bucket views, CPU memory kept between steps:
  `ddpkit.parallel.cpu_allocator`, the optimizer step sharded over the ranks: `ddpkit.step.sharding`),
  parts of them alone, bucket sizes 5 and 100 MB, static graph;
- communication hooks: "shm" (exact shared-memory all-reduce, same machine only) and the lossy fp16 /
  bf16 compressions (listed, never recommended unless --allow-lossy);
- torch.compile (`s.model(net, compile=True)`; compiled in the warm-up steps, from Inductor's cache after
  the first round; see `ddpkit.parallel.compiling`);
- torch's ZeroRedundancyOptimizer (each rank updates 1/N of the parameters, then broadcasts them);
- one process using every core (no DDP at all): on a small CPU machine often the fastest, because
  processes x threads must not exceed the cores and a CPU all-reduce competes with compute for them;
- with --fused, the user's optimizer built with fused=True (reported apart: it changes the user's code).
Then the floor (`ddpkit.bench.floor`): ddpkit's defaults against the one-process step plus the least
gradient exchange at this machine's measured copy bandwidth, as measured / floor. Then one line on
memory: whether the replicated model state fits this machine's memory per rank, or FSDP
(`strategy="fsdp"`) is needed (`ddpkit.strategy.choice`); with `--nodes N` (the job will run on N such
machines) a model that needs sharding gets HSDP's shape, replicate N x shard --nproc, where a node's
share fits (`memory_line`). The recommendation is the configuration with the lowest median step time
among the exact ones, with its gain and the spread that qualifies it.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import nn

from ddpkit.bench import floor, report
from ddpkit.bench.runner import LOSSY_HOOKS, Config, Stats, measure
from ddpkit.errors import problem
from ddpkit.parallel.layout import ClusterShape
from ddpkit.strategy import Chosen, choice, layout_of
from ddpkit.tools import workloads


def candidates(nproc: int, cores: int, *, quick: bool = False, fused: bool = False) -> list[Config]:
    """The configurations tune tries (the first is the baseline)."""
    threads = max(1, cores // nproc)

    def ddp(label: str, **options: Any) -> Config:
        return Config(
            label=label,
            nproc=nproc,
            threads=threads,
            **{"gradient_as_bucket_view": True, "cpu_allocator": True, **options},
        )

    configs = [
        Config(label="hand-written DDP (torch defaults)", nproc=nproc, threads=threads),
        ddp("ddpkit defaults (bucket view, memory kept, sharded step)", shard=True),
        ddp("ddpkit defaults + shm hook", hook="shm", shard=True),
    ]
    if not quick:
        configs += [
            Config(label="torch defaults + memory kept", nproc=nproc, threads=threads, cpu_allocator=True),
            ddp("bucket view, glibc malloc", cpu_allocator=False),
            ddp("bucket view + memory kept (no sharded step)"),
            ddp("bucket 5 MB", bucket_cap_mb=5, shard=True),
            ddp("bucket 100 MB", bucket_cap_mb=100, shard=True),
            ddp("static graph", static_graph=True, shard=True),
            ddp("ddpkit defaults + torch.compile", compile=True, shard=True),
            ddp("ZeRO optimizer", zero=True),
            ddp("shm hook + ZeRO", hook="shm", zero=True),
            ddp("fp16 compression", hook="fp16", shard=True),
            ddp("bf16 compression", hook="bf16", shard=True),
        ]
    if cores > 1:
        configs.append(
            Config(label=f"1 process x {cores} threads (no DDP)", nproc=1, threads=cores, cpu_allocator=True)
        )
        if not quick:
            configs.append(Config(label=f"1 process x {cores} threads, glibc malloc", nproc=1, threads=cores))
    if fused:  # changes the user's optimizer construction: reported apart from the DDP options
        configs += [
            ddp("ddpkit defaults + fused optimizer", fused=True, shard=True),
            ddp("shm hook + fused optimizer", hook="shm", fused=True, shard=True),
        ]
        if cores > 1:
            label = f"1 process x {cores} threads + fused optimizer"
            configs.append(Config(label=label, nproc=1, threads=cores, fused=True, cpu_allocator=True))
    return configs


def recommend(stats: dict[str, Stats], configs: list[Config], allow_lossy: bool) -> tuple[Config, float]:
    """The fastest allowed config and its speed-up over the baseline (the first config)."""
    baseline = stats[configs[0].label].median
    allowed = [c for c in configs if (allow_lossy or c.hook not in LOSSY_HOOKS) and not c.fused]
    best = min(allowed, key=lambda c: stats[c.label].median)
    return best, baseline / stats[best.label].median


def run(ns: argparse.Namespace) -> int:
    cores = report.machine()["cores"]
    nproc = ns.nproc or min(2, cores)
    if ns.nodes < 1:
        raise problem(f"--nodes {ns.nodes} is below 1", "Pass --nodes 1 (this machine) or the job's nodes")
    configs = candidates(nproc, cores, quick=ns.quick, fused=ns.fused)
    before, steal0 = report.machine()["load_average"], report.cpu_steal()
    print(
        f"ddpkit bench tune: workload {ns.workload}, {len(configs)} configurations x {ns.rounds} rounds "
        f"x >= {ns.block_seconds:g} s (interleaved)",
        flush=True,
    )
    stats = measure(
        ns.workload,
        configs,
        rounds=ns.rounds,
        steps=ns.steps,
        warmup=ns.warmup,
        target_s=ns.block_seconds,
        log=print if ns.verbose else None,
    )
    after, steal1 = report.machine()["load_average"], report.cpu_steal()
    base = stats[configs[0].label].median
    rows = []
    for c in sorted(configs, key=lambda c: stats[c.label].median):
        st = stats[c.label]
        lossy = " (lossy)" if c.hook in LOSSY_HOOKS else " (your optimizer changes)" if c.fused else ""
        rows.append(
            [c.label + lossy, st.median * 1e3, f"±{st.spread / 2:.0%}", base / st.median, c.describe()]
        )
    print(report.table(["configuration", "step ms (median)", "spread", "speed-up", "settings"], rows))
    best, gain = recommend(stats, configs, ns.allow_lossy)
    print(
        f"\nrecommendation: {best.label} -- {gain:.2f}x the step rate of hand-written DDP with torch's "
        f"defaults ({stats[best.label].median * 1e3:.0f} ms vs {base * 1e3:.0f} ms per step)"
    )
    print(_how_to(best))
    changed = [c for c in configs if c.fused]
    if changed:
        top = min(changed, key=lambda c: stats[c.label].median)
        gain_fused = base / stats[top.label].median
        print(
            f"beyond ddpkit's options: {top.label} -- {gain_fused:.2f}x (construct your optimizer with "
            "fused=True: one kernel per tensor, the same update up to float rounding)"
        )
    line = floor_of(ns.workload, configs, stats, nproc)
    if line:
        print(line)
    memory = memory_verdict(ns.workload, nproc)
    shape, text = memory_line(memory, ns.nodes, nproc)
    print(f"memory: {text}")
    note = report.load_note(before, after, cores, (steal0, steal1))
    if note:
        print(note)
    data: dict[str, Any] = {
        "workload": ns.workload,
        "machine": report.machine(),
        "load_before": before,
        "load_after": after,
        "configs": [{**c.__dict__, **stats[c.label].as_dict()} for c in configs],
        "recommendation": {"label": best.label, "speedup": gain},
        "memory": {
            "model_state_bytes": memory.state_bytes,
            "device_bytes": memory.device_bytes,
            "fsdp": memory.fsdp,
            "nodes": ns.nodes,
            "shape": shape,
        },
    }
    if ns.json:
        print(f"json: {report.write_json(ns.json, data)}")
    return 0


def floor_of(workload: str, configs: list[Config], stats: dict[str, Stats], nproc: int) -> str | None:
    """ddpkit's defaults at `nproc` ranks against what the machine allows: the one-process step plus the
    least gradient exchange at this machine's copy bandwidth (`ddpkit.bench.floor`); None without a
    one-process configuration to compare with."""
    ranks = next((c for c in configs if c.nproc > 1 and c.shard and c.hook == "allreduce"), None)
    one = next((c for c in configs if c.nproc == 1 and not c.fused), None)
    if ranks is None or one is None:
        return None
    grads = floor.grad_bytes_of(workloads.load(workload).build())
    return floor.floor_line(
        stats[ranks.label].median, stats[one.label].median, grads, nproc, floor.copy_bandwidth()
    )


def memory_verdict(workload: str, nproc: int) -> choice.MemoryVerdict:
    """Whether the workload's replicated model state fits one rank's share of this machine (or FSDP)."""
    w = workloads.load(workload)
    optimizer = w.optimizer(nn.Linear(1, 1).parameters())  # the kind of optimizer, for its state size
    state = choice.model_state_bytes(w.build(), choice.optimizer_slots(optimizer))
    return choice.verdict(state, choice.device_bytes(torch.device("cpu"), nproc), nproc)


def memory_line(memory: choice.MemoryVerdict, nodes: int, per_node: int) -> tuple[str, str]:
    """(the shape, the memory line) for a job of `nodes` machines of `per_node` ranks each. DDP where the
    replicated state fits; else one node: FSDP over its ranks; several: HSDP, replicate `nodes` x shard
    `per_node` (each node holds the state sharded over its own ranks and sends one all-reduce of its
    shards to the other nodes per step), when a node's share fits; FSDP over all ranks when not."""
    gb = 1e9
    if not memory.fsdp:
        return "ddp", memory.text
    ranks = nodes * per_node
    if nodes <= 1:
        return f"fsdp {per_node}", memory.text
    hsdp = layout_of(Chosen("hsdp"), ClusterShape(ranks, per_node))  # the session's degrees on this job
    share = memory.state_bytes / hsdp.shard
    if share <= choice.FITS_SHARE * memory.device_bytes:
        return f"hsdp {hsdp.describe(short=True)}", (
            f"{memory.text}; on {nodes} nodes x {per_node} ranks use strategy='hsdp' instead: "
            f"{hsdp.describe()}, {share / gb:.2f} GB per rank, sharded inside each node (one "
            "all-reduce of the shards between nodes per step, where FSDP over all ranks sends every "
            "all-gather and reduce-scatter between them)"
        )
    return f"fsdp {ranks}", (
        f"{memory.text}; on {nodes} nodes x {per_node} ranks: a node's share ({share / gb:.2f} GB per rank "
        f"sharded {per_node} ways) does not fit either, so FSDP over all {ranks} ranks "
        f"({memory.state_bytes / ranks / gb:.2f} GB per rank), not HSDP"
    )


def _how_to(cfg: Config) -> str:
    if cfg.nproc == 1:
        return f"how: `python train.py`: one process, torch uses {cfg.threads} threads; no DDP"
    opts = []
    if cfg.bucket_cap_mb:
        opts.append(f"bucket_cap_mb={cfg.bucket_cap_mb:g}")
    if cfg.static_graph:
        opts.append("static_graph=True")
    if cfg.hook != "allreduce":
        opts.append(f'comm_hook="{cfg.hook}"')
    if not cfg.gradient_as_bucket_view:
        opts.append("gradient_as_bucket_view=False")
    if cfg.compile:
        opts.append("compile=True")
    how = f"how: s.model(net{', ' if opts else ''}{', '.join(opts)}) with `ddpkit run --nproc {cfg.nproc}`"
    if not cfg.shard and not cfg.zero:
        how += "; ddpkit.session(shard_optimizer=False)"
    if cfg.zero:
        how += "; optimizer: torch.distributed.optim.ZeroRedundancyOptimizer(params, optimizer_class=...)"
    return how


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", default="mlp", help="cnn, mlp, gpt, or package.module:function")
    p.add_argument("--nproc", type=int, default=None, help="DDP processes (default: 2, or 1 on one core)")
    p.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="machines like this one the job will run on: where the model needs sharding, the "
        "memory line names HSDP's shape (replicate NODES x shard NPROC)",
    )
    p.add_argument("--rounds", type=int, default=3, help="rotations through all configurations")
    p.add_argument("--steps", type=int, default=3, help="at least this many timed steps per block")
    p.add_argument("--block-seconds", type=float, default=1.0, help="at least this long per timed block")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="only the baseline, ddpkit, shm and one process")
    p.add_argument("--allow-lossy", action="store_true", help="may recommend fp16/bf16 compression")
    p.add_argument("--fused", action="store_true", help="also try your optimizer with fused=True")
    p.add_argument("--json", default=None, help="write the measurements here")
    p.add_argument("-v", "--verbose", action="store_true", help="print every block as it finishes")
