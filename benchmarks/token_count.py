"""What token weighting costs: the one int64 all-reduce of s.step, against the step it belongs to.

    python benchmarks/token_count.py                # 2 gloo ranks, the `gpt` workload's model
    python benchmarks/token_count.py --nproc 3 --reps 20

Each rank trains the `gpt` workload's TinyGPT (4 layers, d 256, seq 128, vocab 4096) on right-padded
sequences of random lengths, alternating steps with a mean loss (s.backward(loss)) and with a token sum
(s.backward(loss_sum, tokens=n)), so both see the same machine load; it also times the bare all-reduce
of one int64 (1,000 of them) and the rescale's multiply over the gradients. Rank 0 prints medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import ddpkit
from ddpkit.tools.workloads import TinyGPT


def _rank(reps: int, per_rank: int, accumulation: int) -> dict[str, float]:
    with ddpkit.session(seed=0, accumulation=accumulation, verbose=False) as s:
        net = s.model(TinyGPT())
        opt = torch.optim.AdamW(net.parameters(), lr=3e-4)
        g = torch.Generator().manual_seed(s.rank)
        times: dict[str, list[float]] = {"mean": [], "tokens": []}
        for rep in range(2 * reps + 2):
            mode = ("mean", "tokens")[rep % 2]
            s.barrier()
            start = time.perf_counter()
            for _ in range(accumulation):
                x = torch.randint(0, 4096, (per_rank, 128), generator=g)
                y = torch.randint(0, 4096, (per_rank, 128), generator=g)
                y[torch.rand(per_rank, 128, generator=g) < 0.3] = -100
                with s.accumulate(net):
                    logits = net(x).flatten(0, 1)
                    if mode == "tokens":
                        loss_sum = F.cross_entropy(logits, y.flatten(), reduction="sum")
                        s.backward(loss_sum, tokens=(y != -100).sum())
                    else:
                        s.backward(F.cross_entropy(logits, y.flatten()))
                s.step(opt)
            if rep >= 2:  # the first two are warm-up
                times[mode].append(time.perf_counter() - start)
        grads = [torch.ones_like(p) for p in net.parameters()]  # the rescale's one pass over them
        passes = []
        for _ in range(20):
            start = time.perf_counter()
            torch._foreach_mul_(grads, 1.0)
            passes.append(time.perf_counter() - start)
        one = torch.zeros(1, dtype=torch.int64)
        s.barrier()
        start = time.perf_counter()
        for _ in range(1000):
            dist.all_reduce(one)
        allreduce = (time.perf_counter() - start) / 1000
        return {
            "mean_step_s": statistics.median(times["mean"]),
            "tokens_step_s": statistics.median(times["tokens"]),
            "allreduce_int64_s": allreduce,
            "rescale_pass_s": statistics.median(passes),
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--reps", type=int, default=10, help="timed steps per mode, interleaved")
    p.add_argument("--per-rank", type=int, default=4, help="sequences per micro-batch and rank")
    p.add_argument("--accumulation", type=int, default=1)
    a = p.parse_args()
    results = ddpkit.spawn(_rank, a.nproc, (a.reps, a.per_rank, a.accumulation), timeout=900, threads=1)
    r = results[0]
    extra = r["tokens_step_s"] - r["mean_step_s"]
    print(
        f"{a.nproc} ranks, accumulation {a.accumulation}, {a.per_rank} x 128 tokens per micro-batch: "
        f"step {r['mean_step_s'] * 1e3:.1f} ms (mean loss) vs {r['tokens_step_s'] * 1e3:.1f} ms (token sum), "
        f"difference {extra * 1e3:+.2f} ms ({extra / r['mean_step_s']:+.1%}); one int64 all-reduce "
        f"{r['allreduce_int64_s'] * 1e6:.0f} us ({r['allreduce_int64_s'] / r['mean_step_s']:.2%} of the "
        "step); "
        f"the rescale's pass over the gradients {r['rescale_pass_s'] * 1e3:.2f} ms "
        f"({r['rescale_pass_s'] / r['mean_step_s']:.2%})"
    )


if __name__ == "__main__":
    main()
