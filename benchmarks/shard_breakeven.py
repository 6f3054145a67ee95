"""Where does the sharded optimizer step start to pay? Plain `opt.step()` vs ddpkit's sharded step.

    flock /tmp/ddpkit-cpu.lock .venv/bin/python benchmarks/shard_breakeven.py          # about a minute

2 CPU ranks x 1 thread (gloo + ddpkit's shared-memory publishing), models of 4 Linear(d, d) layers
(1 K to 17 M parameters), SGD with momentum (the cheapest per-parameter update) and AdamW. Each rank
holds the same gradients, as after DDP's all-reduce; the timed part is the optimizer step alone: the
plain step on every rank, or each rank stepping its share and the owners publishing through shared
memory. Plain and sharded blocks alternate, repeated `--rounds` times; the ratio sharded / plain is
taken per round and summarised as median [min, max]. `ddpkit.step.sharding.AUTO_MIN_PARAMETERS` is set
from this table: below it, shard_optimizer="auto" does not shard.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import ddpkit  # noqa: E402

WIDTHS = (16, 32, 64, 128, 256, 512, 1024, 2048)


def _block(step: Any, target_s: float) -> float:
    """Seconds per call of `step`, over a block of about `target_s` (every rank runs the same count)."""
    import torch.distributed as dist

    start = time.perf_counter()
    step()
    n = torch.tensor(max(5, int(target_s / max(time.perf_counter() - start, 1e-6))))
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(int(n)):
        step()
    return (time.perf_counter() - start) / int(n)


def rank_main(widths: list[int], rounds: int, target_s: float) -> dict[str, Any]:
    from ddpkit.step import sharding

    out: dict[str, Any] = {}
    with ddpkit.session(seed=0, verbose=False, shard_optimizer=False) as s:
        for name in ("sgd", "adamw"):
            for d in widths:
                torch.manual_seed(0)
                model = torch.nn.Sequential(*[torch.nn.Linear(d, d) for _ in range(4)])
                for p in model.parameters():
                    p.grad = torch.randn_like(p)
                make = {
                    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9),
                    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-4),
                }[name]
                plain = make(model.parameters())
                sharded_opt = make(model.parameters())
                sharder = sharding.choose(sharded_opt, True, s.device)
                assert sharder is not None
                ratios, plain_s, sharded_s = [], [], []
                for _ in range(rounds):
                    a = _block(plain.step, target_s)
                    b = _block(lambda: sharder.step(sharded_opt.step), target_s)  # noqa: B023
                    plain_s.append(a)
                    sharded_s.append(b)
                    ratios.append(b / a)
                params = sum(p.numel() for p in model.parameters())
                out[f"{name}/{d}"] = {
                    "params": params,
                    "plain_s": plain_s,
                    "sharded_s": sharded_s,
                    "ratio": ratios,
                }
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--block-seconds", type=float, default=0.3)
    ns = p.parse_args()
    load = os.getloadavg()
    res = ddpkit.spawn(
        rank_main, nproc=2, args=(list(WIDTHS), ns.rounds, ns.block_seconds), threads=1, timeout=1200
    )[0]
    print(f"2 ranks x 1 thread; load average {load[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end")
    print("| optimizer | parameters | plain step, ms | sharded step, ms | sharded / plain, per round |")
    print("|---|---|---|---|---|")
    for key, r in res.items():
        rs = r["ratio"]
        print(
            f"| {key.split('/')[0]} | {r['params']:,} | {statistics.median(r['plain_s']) * 1e3:.3f} | "
            f"{statistics.median(r['sharded_s']) * 1e3:.3f} | "
            f"{statistics.median(rs):.2f} [{min(rs):.2f}, {max(rs):.2f}] |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
