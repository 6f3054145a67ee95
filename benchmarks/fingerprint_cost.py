"""What replica fingerprints cost per step: a step with and without a check, interleaved.

    flock /tmp/ddpkit-cpu.lock .venv/bin/python benchmarks/fingerprint_cost.py --workload mlp
    flock /tmp/ddpkit-cpu.lock .venv/bin/python benchmarks/fingerprint_cost.py --workload gpt

2 gloo ranks (1 thread each) train one of ddpkit's named workloads (ddpkit/tools/workloads.py) with
`s.accumulate` / `s.backward` / `s.step`. Two modes: "plain" (the step alone) and "checked" (the step, then
`ReplicaFingerprints(1).after_step`: the hashes of every parameter and buffer, and of the optimizer's state
where it is replicated (`--no-shard-optimizer`; the session's default shards it over the ranks, and a rank's
share is not compared), then the one all-reduce of two int64). Every round runs one step of each mode, in an
order shuffled from round to round (the same seed on every rank), so both see the same load. Rank 0 prints
the median of the repeats' median step times with their range, the time inside the check itself (timed in
the real step) with its range, and what that check costs per step at N = 1, 10, 100, 1000 (the check's
median / N, as a share of the plain step). `uptime`'s load is printed before and after.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch

import ddpkit
from ddpkit.step.fingerprint import ReplicaFingerprints
from ddpkit.tools import workloads

MODES = ("plain", "checked")


def _rank(name: str, repeats: int, rounds: int, shard: bool | str) -> dict:
    w = workloads.load(name)
    with ddpkit.session(seed=0, verbose=False, log_to=None, shard_optimizer=shard) as s:
        torch.manual_seed(0)
        net = s.model(w.build())
        opt = w.optimizer(net.parameters())
        batch = w.sample(torch.Generator().manual_seed(s.rank), w.global_batch // s.world_size)
        prints = ReplicaFingerprints(1)
        step_once(s, net, opt, w, batch)  # the optimizer's first step decides whether it is sharded
        replicated = opt if s.stepper.sharded_step(opt) is None else None  # sharded: each rank its own

        def step(mode: str, n: int) -> float:
            step_once(s, net, opt, w, batch)
            if mode != "checked":
                return 0.0
            start = time.perf_counter()
            prints.after_step(n, net, replicated)
            return time.perf_counter() - start

        for n in range(3):
            step("checked", n + 1)  # warm up (the optimizer's state exists from here on)
        order = random.Random(0)
        medians: dict[str, list[float]] = {m: [] for m in MODES}
        inside: list[float] = []
        n = 3
        for _ in range(repeats):
            times: dict[str, list[float]] = {m: [] for m in MODES}
            spent: list[float] = []
            for _ in range(rounds):
                for mode in order.sample(MODES, len(MODES)):
                    s.barrier()
                    n += 1
                    start = time.perf_counter()
                    took = step(mode, n)
                    times[mode].append(time.perf_counter() - start)
                    if mode == "checked":
                        spent.append(took)
            for mode in MODES:
                medians[mode].append(statistics.median(times[mode]))
            inside.append(statistics.median(spent))
        tensors = sum(1 for _ in net.parameters()) + (
            sum(len(v) for v in opt.state.values()) if replicated else 0
        )
        return {
            "medians": medians,
            "inside": inside,
            "tensors": tensors,
            "optimizer": "replicated, hashed" if replicated else "sharded (not replicated): not hashed",
        }


def step_once(
    s: ddpkit.Session,
    net: torch.nn.Module,
    opt: torch.optim.Optimizer,
    w: workloads.Workload,
    batch: workloads.Batch,
) -> None:
    with s.accumulate(net):
        s.backward(w.step_loss(net, batch))
    s.step(opt)


def _range(values: list[float], scale: float = 1e3) -> str:
    return f"{statistics.median(values) * scale:.3f} [{min(values) * scale:.3f}, {max(values) * scale:.3f}]"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="mlp")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument(
        "--no-shard-optimizer",
        action="store_true",
        help="shard_optimizer=False: every rank holds the whole optimizer state, which is hashed too",
    )
    a = p.parse_args()
    print(f"load before: {os.getloadavg()[0]:.2f}")
    r = ddpkit.spawn(
        _rank,
        a.nproc,
        (a.workload, a.repeats, a.rounds, False if a.no_shard_optimizer else "auto"),
        timeout=1800,
        threads=1,
    )[0]
    print(f"load after: {os.getloadavg()[0]:.2f}")
    print(
        f"{a.workload}: {a.nproc} ranks, {a.repeats} repeats x {a.rounds} interleaved rounds, "
        f"{r['tensors']} tensors hashed per check; optimizer state {r['optimizer']}"
    )
    plain, checked, inside = r["medians"]["plain"], r["medians"]["checked"], r["inside"]
    print("| mode | median step ms [range over repeats] |\n|---|---|")
    print(f"| plain | {_range(plain)} |\n| checked (N=1) | {_range(checked)} |")
    base = statistics.median(plain)
    print(f"inside the check: {_range(inside)} ms = {statistics.median(inside) / base:.2%} of a plain step")
    for every in (1, 10, 100, 1000):
        print(f"  every {every}: {statistics.median(inside) / every / base:.3%} of a step")


if __name__ == "__main__":
    main()
