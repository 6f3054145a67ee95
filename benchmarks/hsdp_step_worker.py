"""One host's ranks for benchmarks/hsdp_step.py, started by `ddpkit run --nnodes 2 --nproc 2` inside a
network namespace (two namespaces = two "hosts" of 2 ranks, joined by a rate-limited veth).

    hsdp_step_worker.py links OUT.json [--max-mb 8 --reps 4]
    hsdp_step_worker.py train OUT.json --strategy hsdp|fsdp|ddp [--workload gpt --global-batch 24 ...]

`links`: the two levels the planner's 2-node model needs, measured with gloo as `ddpkit bench
collectives` measures one machine (each size: warm-up, then the median of `--reps` calls, the slowest
rank's): all_reduce, all_gather_into_tensor and reduce_scatter_tensor (S = the full size) inside a host
(the shard groups {0,1} and {2,3}, both at once: what HSDP's shard groups do) and between the hosts
(ranks 0 and 2 alone: one rank per node, the link to itself, as the planner's inter-node level is
defined; and both pairs {0,2}, {1,3} at once: what HSDP's replica all-reduces do).
`train`: `ddpkit.session(strategy=...)`, the workload's model, per-rank batch = global / 4, `s.backward;
s.step` timed per step on global rank 0 (the collectives make it every rank's). Rank 0 writes OUT.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

MB = 1 << 20


def _time(fn: Any, reps: int, group: Any) -> float:
    fn()  # warm-up: connections, buffers
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    mine = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group)  # the slowest rank's median
    return float(mine)


def links(out: str, max_mb: float, reps: int) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 4, f"run on 2 hosts x 2 ranks, not world {world}"
    hosts = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    host, pair = hosts[rank // 2], pairs[rank % 2]
    sizes = [s for s in (64 * 1024, 256 * 1024, MB, 4 * MB, 8 * MB, 16 * MB, 32 * MB) if s <= max_mb * MB]
    rows: list[dict[str, Any]] = []

    def ops(group: Any, n: int, nbytes: int) -> dict[str, Any]:
        full = torch.ones(nbytes // 4)
        part = torch.ones(nbytes // 4 // n)
        return {
            "all_reduce": lambda: dist.all_reduce(full, group=group),
            "all_gather": lambda: dist.all_gather_into_tensor(full, part, group=group),
            "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, full, group=group),
        }

    # (level, group of this rank or None when it sits this one out)
    plans = [("intra", host), ("inter_alone", pair if rank in (0, 2) else None), ("inter_both", pair)]
    for level, group in plans:
        for nbytes in sizes:
            for op in ("all_reduce", "all_gather", "reduce_scatter"):
                dist.barrier()
                t = _time(ops(group, 2, nbytes)[op], reps, group) if group is not None else 0.0
                got = torch.tensor([t], dtype=torch.float64)
                dist.all_reduce(got, op=dist.ReduceOp.MAX)
                rows.append({"level": level, "op": op, "bytes": nbytes, "seconds": float(got)})
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def train(out: str, ns: argparse.Namespace) -> None:
    import ddpkit
    from ddpkit.tools import workloads

    torch.set_num_threads(1)
    wl = workloads.load(ns.workload)
    with ddpkit.session(seed=0, strategy=ns.strategy) as s:
        model = s.model(wl.build())
        opt = wl.optimizer(model.parameters())
        x, y = wl.sample(torch.Generator().manual_seed(1 + s.rank), ns.global_batch // s.world_size)
        times, sent = [], 0
        for i in range(ns.warmup + ns.steps):
            if i == ns.warmup:
                s.barrier()
                sent = -_tx_bytes()
            t0 = time.perf_counter()
            s.backward(wl.step_loss(model, (x, y)))
            s.step(opt)
            times.append(time.perf_counter() - t0)
        s.barrier()
        sent += _tx_bytes()
        if s.rank == 0:
            with open(out, "w") as f:
                json.dump(
                    {
                        "strategy": ns.strategy,
                        "world": s.world_size,
                        "steps_s": times[ns.warmup :],
                        "warmup_s": times[: ns.warmup],
                        "link_bytes_per_step": sent / ns.steps,
                    },
                    f,
                )


def _tx_bytes() -> int:
    """Bytes this host has sent over the inter-host link (its veth, GLOO_SOCKET_IFNAME), all ranks'."""
    with open(f"/sys/class/net/{os.environ['GLOO_SOCKET_IFNAME']}/statistics/tx_bytes") as f:
        return int(f.read())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("links", "train"))
    ap.add_argument("out")
    ap.add_argument("--max-mb", type=float, default=8.0)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--strategy", default="hsdp")
    ap.add_argument("--workload", default="gpt")
    ap.add_argument("--global-batch", type=int, default=24)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ns = ap.parse_args()
    torch.set_num_threads(1)
    if ns.mode == "links":
        links(ns.out, ns.max_mb, ns.reps)
    else:
        train(ns.out, ns)


if __name__ == "__main__":
    main()
