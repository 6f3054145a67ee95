"""Activation checkpointing on the `gpt` workload: the memory it saves and the time it costs (issue 30).

    python benchmarks/recompute_memory.py                   # 2 DDP ranks x 1 thread, 6 timed steps
    python benchmarks/recompute_memory.py --strategy fsdp --steps 8

Each mode runs in fresh ranks ("spawn"): `s.model(workload.build(), activation_checkpointing=Block)` or
without it. Per rank: the peak RSS from process start (`ru_maxrss`) and the RSS before `s.model` (what the
step itself adds shows as the difference), and the median step time after one warm-up step (wall clock
on rank 0 between barriers). The workload's batch is scaled by `--batch-scale` so that activations, which
checkpointing trades for compute, are a visible part of the peak.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import ddpkit
from ddpkit.tools import workloads


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return int(next(x for x in f if x.startswith("VmRSS:")).split()[1]) / 1024


def _rank(strategy: str, recompute: bool, steps: int, scale: int) -> dict:
    from ddpkit.tools.workloads import Block

    workload = workloads.load("gpt")
    with ddpkit.session(seed=0, verbose=False) as s:
        before = _rss_mib()
        recomputed = Block if recompute else None
        model = s.model(workload.build(), strategy=strategy, activation_checkpointing=recomputed)
        opt = workload.optimizer(model.parameters())
        loader = s.loader(workload.dataset(batches=steps + 1), batch_size=workload.global_batch * scale // 4)
        times = []
        for i, batch in enumerate(loader):
            s.barrier()
            start = time.perf_counter()
            with s.accumulate(model):
                s.backward(workload.step_loss(model, batch))
            s.step(opt)
            s.barrier()
            if i > 0:
                times.append(time.perf_counter() - start)
        return {
            "before": before,
            "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "step_s": statistics.median(times),
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strategy", default="ddp", choices=("ddp", "fsdp"))
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch-scale", type=int, default=4, help="global batch = 16 x scale / 4 (default 16)")
    ns = p.parse_args()
    print(f"gpt workload, {ns.strategy}, {ns.nproc} ranks x 1 thread; MiB per rank (rank 0 / rank 1)")
    print("| activation checkpointing | RSS before s.model | peak RSS | peak - before | step (s, median) |")
    print("|---|---|---|---|---|")
    for recompute in (False, True):
        ranks = ddpkit.spawn(
            _rank, ns.nproc, (ns.strategy, recompute, ns.steps, ns.batch_scale), threads=1, timeout=600
        )

        def fmt(key: str, ranks: list = ranks) -> str:
            return " / ".join(f"{r[key]:.0f}" for r in ranks)

        grown = " / ".join(f"{r['peak'] - r['before']:.0f}" for r in ranks)
        print(
            f"| {'Block' if recompute else 'off'} | {fmt('before')} | {fmt('peak')} | {grown} | "
            f"{ranks[0]['step_s']:.3f} |"
        )


if __name__ == "__main__":
    main()
