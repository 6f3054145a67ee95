"""What ddpkit costs per step: one loop hand-written with plain DDP and written with ddpkit, side by side.

    python benchmarks/overhead.py                         # cnn, mlp and gpt; 2 CPU ranks x 1 thread
    python benchmarks/overhead.py --workload cnn --rounds 9 --json runs/overhead.json

Both loops run in the same two processes (one gloo group), as alternating blocks of whole epochs, so
machine drift hits both alike; the ratio ddpkit / plain is taken per round (a pair of neighbouring
blocks) and summarised as median and [min, max] over rounds. Same settings on both sides: the plain
loop passes gradient_as_bucket_view=True, which ddpkit does by default; DistributedSampler with
set_epoch, a DataLoader of the same per-rank batch, AdamW/SGD as the workload defines. A third block,
plain DDP with torch's defaults (gradient copies), shows what ddpkit's default is worth. Goal: <= 1.01.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

import ddpkit
from ddpkit.tools import workloads


def plain_setup(wl: workloads.Workload, data, view: bool):
    """Hand-written DDP, as the PyTorch tutorial writes it."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(wl.build(), gradient_as_bucket_view=view)
    opt = wl.optimizer(model.parameters())
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=wl.global_batch // dist.get_world_size(), sampler=sampler)
    return model, opt, loader, sampler


def plain_epoch(wl, model, opt, loader, sampler, epoch: int) -> int:
    sampler.set_epoch(epoch)  # what ddpkit's loader does by itself
    return ddpkit_epoch(wl, model, opt, loader)


def ddpkit_setup(s: ddpkit.Session, wl: workloads.Workload, data):
    torch.manual_seed(0)
    model = s.model(wl.build())
    opt = wl.optimizer(model.parameters())
    loader = s.loader(data, batch_size=wl.global_batch, shuffle=True)
    return model, opt, loader


def ddpkit_epoch(wl, model, opt, loader) -> int:
    """The training loop body, identical for both sides so only the set-up differs."""
    steps = 0
    for x, y in loader:
        out = model(x)
        loss = wl.loss(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps += 1
    return steps


def rank_main(spec: str, rounds: int, batches: int) -> dict:
    """One rank: build the three loops, then alternate epochs of each, `rounds` times."""
    wl = workloads.load(spec)
    data = wl.dataset(batches=batches)
    plain = plain_setup(wl, data, view=True)
    torch_default = plain_setup(wl, data, view=False)
    with ddpkit.session(seed=0, verbose=False) as s:
        kit = ddpkit_setup(s, wl, data)
        run = {
            "plain": lambda e: plain_epoch(wl, *plain, e),
            "ddpkit": lambda e: ddpkit_epoch(wl, *kit),
            "plain_torch_defaults": lambda e: plain_epoch(wl, *torch_default, e),
        }
        for name in run:  # warm-up epoch each
            run[name](0)
        times: dict[str, list[float]] = {name: [] for name in run}
        order = list(run)
        for r in range(rounds):
            for name in order if r % 2 == 0 else order[::-1]:  # ABC CBA: no variant always goes first
                dist.barrier()
                start = time.perf_counter()
                steps = run[name](r + 1)
                times[name].append((time.perf_counter() - start) / steps)
        assert dist.get_world_size() == s.world_size
        return {"times": times, "world": dist.get_world_size(), "threads": torch.get_num_threads()}


def summarise(times: dict[str, list[float]], a: str, b: str) -> tuple[float, float, float]:
    """Median and [min, max] of the per-round ratio a / b."""
    ratios = [x / y for x, y in zip(times[a], times[b], strict=True)]
    return statistics.median(ratios), min(ratios), max(ratios)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="cnn,mlp,gpt")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--batches", type=int, default=0, help="global batches per epoch (default per workload)")
    p.add_argument("--json", default=None)
    ns = p.parse_args(argv)
    default_batches = {"cnn": 64, "mlp": 4, "gpt": 3}
    load = os.getloadavg()
    print(
        f"overhead: {ns.nproc} ranks x 1 thread, gloo; load average {load[0]:.2f} (cores: "
        f"{len(os.sched_getaffinity(0))})",
        flush=True,
    )
    rows = {}
    for spec in ns.workload.split(","):
        batches = ns.batches or default_batches.get(spec, 4)
        args = (spec, ns.rounds, batches)
        out = ddpkit.spawn(rank_main, nproc=ns.nproc, args=args, threads=1, timeout=1800)
        t = out[0]["times"]
        assert out[0]["world"] == ns.nproc and out[0]["threads"] == 1, out[0]
        med, lo, hi = summarise(t, "ddpkit", "plain")
        dmed, dlo, dhi = summarise(t, "ddpkit", "plain_torch_defaults")
        rows[spec] = {
            "plain_ms": statistics.median(t["plain"]) * 1e3,
            "ddpkit_ms": statistics.median(t["ddpkit"]) * 1e3,
            "plain_torch_defaults_ms": statistics.median(t["plain_torch_defaults"]) * 1e3,
            "ratio_same_settings": [med, lo, hi],
            "ratio_vs_torch_defaults": [dmed, dlo, dhi],
            "samples_s": t,
        }
        r = rows[spec]
        print(
            f"{spec:4s} plain DDP {r['plain_ms']:7.1f} ms  ddpkit {r['ddpkit_ms']:7.1f} ms  "
            f"ratio {med:.3f} [{lo:.3f}, {hi:.3f}]   (vs torch-default DDP "
            f"{r['plain_torch_defaults_ms']:.1f} ms: ratio {dmed:.3f} [{dlo:.3f}, {dhi:.3f}])",
            flush=True,
        )
    after = os.getloadavg()
    print(
        f"ratio = ddpkit step time / hand-written DDP step time, same settings (goal <= 1.01); median "
        f"[min, max] over {ns.rounds} rounds. Load average at end {after[0]:.2f}"
        + (" -- busy machine, provisional" if max(load[0], after[0]) > 1.0 else "")
    )
    if ns.json:
        import json

        os.makedirs(os.path.dirname(ns.json) or ".", exist_ok=True)
        with open(ns.json, "w") as f:
            json.dump({"load": [load, after], "workloads": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
