"""Where a step's time goes, phase by phase: forward, backward (with DDP's all-reduce), `s.step`.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/step_phases.py mlp    # one process, 2 threads
    ddpkit run --nproc 2 benchmarks/step_phases.py mlp                  # 2 ranks x 1 thread

The README loop on a workload of ddpkit/tools/workloads.py, 25 steps; rank 0 prints the median of steps
6..25 of each phase (time.perf_counter around `model(x)` + loss, `s.backward`, `s.step`). Used for
docs/performance.md section 8 (threads vs ranks).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import ddpkit
from ddpkit.tools.workloads import NAMED


def main(name: str) -> None:
    wl = NAMED[name]
    with ddpkit.session(seed=0, verbose=False) as s:
        torch.manual_seed(0)
        model = s.model(wl.build())
        opt = wl.optimizer(model.parameters())
        x, y = wl.sample(torch.Generator().manual_seed(s.rank), wl.global_batch // s.world_size)
        phases: dict[str, list[float]] = {"forward": [], "backward": [], "step": [], "whole step": []}
        for i in range(25):
            t0 = time.perf_counter()
            out = model(x)
            loss = wl.loss(out.reshape(-1, out.shape[-1]), y.reshape(-1))
            t1 = time.perf_counter()
            s.backward(loss)
            t2 = time.perf_counter()
            s.step(opt)
            t3 = time.perf_counter()
            if i >= 5:
                for key, took in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t3 - t0), strict=True):
                    phases[key].append(took)
        if s.is_main:
            cells = ", ".join(f"{k} {statistics.median(v) * 1e3:.1f} ms" for k, v in phases.items())
            print(f"{name}, world size {s.world_size} x {torch.get_num_threads()} thread(s): {cells}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "mlp")
