"""The host time ddpkit's step API adds per step, on a model whose compute is near zero.

    python benchmarks/step_api_cost.py              # 5 interleaved runs of 2000 steps, one thread
    python benchmarks/step_api_cost.py --profile    # and ddpkit's own frames under cProfile

A launch-bound GPU step (the host queues kernels as fast as it can; docs/gpu.md) pays this cost in
full, a compute-bound one hides it. Both sides: 8 Linear(8, 8) layers, batch 4, Adam, one process, one
thread, the same batches already in memory. Plain: `zero_grad / backward / step`. ddpkit:
`s.accumulate`, `s.backward`, `s.step` in a single-process session (its step anatomy's marks and
per-parameter gradient hooks included: they are always on).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch
from torch import nn

import ddpkit

LOSS = nn.functional.mse_loss


def _build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(8)])


def plain(batches: list) -> float:
    model = _build()
    opt = torch.optim.Adam(model.parameters())
    start = time.perf_counter()
    for x, y in batches:
        loss = LOSS(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return (time.perf_counter() - start) / len(batches)


def through_ddpkit(batches: list, profiler: cProfile.Profile | None = None) -> float:
    with ddpkit.session(seed=0, env={}, verbose=False) as s:
        model = s.model(_build())
        opt = torch.optim.Adam(model.parameters())
        if profiler:
            profiler.enable()
        start = time.perf_counter()
        for x, y in batches:
            with s.accumulate(model):
                s.backward(LOSS(model(x), y))
            s.step(opt)
        seconds = (time.perf_counter() - start) / len(batches)
        if profiler:
            profiler.disable()
        return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--profile", action="store_true")
    ns = p.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)) for _ in range(ns.steps)]
    a, b = [], []
    for _ in range(ns.runs):  # interleaved: drift hits both alike
        a.append(plain(batches))
        b.append(through_ddpkit(batches))
    pa, pb = statistics.median(a) * 1e6, statistics.median(b) * 1e6
    print(
        f"step_api_cost: plain {pa:.1f} us/step [{min(a) * 1e6:.1f}, {max(a) * 1e6:.1f}], ddpkit {pb:.1f} "
        f"us/step [{min(b) * 1e6:.1f}, {max(b) * 1e6:.1f}]: +{pb - pa:.1f} us a step "
        f"(median of {ns.runs} runs of {ns.steps} steps, one thread)"
    )
    if ns.profile:
        profiler = cProfile.Profile()
        through_ddpkit(batches, profiler)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(r"ddpkit/", 15)


if __name__ == "__main__":
    main()
