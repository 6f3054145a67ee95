"""torch.compile with DDP on CPU ranks: which order, what it costs to compile, what a warm cache saves.

    python benchmarks/compile_orders.py --workload cnn --modes eager,inner,outer   # 2 CPU ranks x 1 thread
    python benchmarks/compile_orders.py --workload gpt --modes inner --cache warm --steps 20

Each mode runs in fresh processes (`ddpkit.spawn`, so nothing compiled in one mode leaks into the next):
- eager: `s.model(net)`;
- inner: `s.model(net, compile=True)`: the module compiled, then wrapped in DDP (torch's "where to apply
  compile" guidance; what ddpkit does);
- outer: `torch.compile(s.model(net))`: DDP compiled from outside, TorchDynamo's DDPOptimizer splits the
  graph at bucket boundaries;
- ca: outer, with compiled autograd and DDP's python reducer (`optimize_ddp="python_reducer"`).
- fsdp / fsdp-inner: FSDP2 (each `Block` its own unit), eager / `s.model(net, strategy=..., compile=True)`:
  each block compiled in place before `fully_shard` (the torchtitan order).
`--cache cold` gives every run an empty Inductor cache directory; `warm` fills it with one run first
and then times a second run against it; `keep` uses one directory for every mode and invocation
(repeat the modes for interleaved rounds of steady steps: `--modes eager,inner,outer,eager,...`).
First step: the wall time of the first forward, backward and
optimizer step (compilation included) on global rank 0; steady step: the median of the next `--steps`
steps and their spread (max - min) / median. Prints one JSON line per mode (the load next to it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

import ddpkit
from ddpkit.tools import workloads


def body(spec: str, mode: str, steps: int) -> dict:
    wl = workloads.load(spec)
    with ddpkit.session(seed=0, verbose=False) as s:
        import torch._dynamo.config as dynamo_config

        torch.manual_seed(0)
        net = wl.build()
        if mode == "inner":
            model = s.model(net, compile=True)
        elif mode in ("outer", "ca"):
            if mode == "ca":
                dynamo_config.optimize_ddp = "python_reducer"
                dynamo_config.compiled_autograd = True
            model = torch.compile(s.model(net))
        elif mode in ("fsdp", "fsdp-inner"):  # FSDP2, each gpt Block a unit; fsdp-inner: compiled first
            blocks = tuple({type(m) for m in net.modules() if type(m).__name__ == "Block"}) or None
            model = s.model(net, strategy=ddpkit.FSDPOptions(blocks=blocks), compile=mode == "fsdp-inner")
        else:
            model = s.model(net)
        opt = wl.optimizer(model.parameters())
        x, y = wl.sample(torch.Generator().manual_seed(1 + s.rank), wl.global_batch // s.world_size)
        times = []
        for _ in range(steps + 1):
            s.barrier()
            start = time.perf_counter()
            with s.accumulate(model):
                s.backward(wl.step_loss(model, (x, y)))
            s.step(opt)
            times.append(time.perf_counter() - start)
        loss = float(s.all_reduce(wl.step_loss(model, (x, y)).detach(), op="mean"))
    from torch._dynamo.utils import counters

    steady = times[1:]
    med = statistics.median(steady)
    return {
        "first_s": times[0],
        "step_ms": med * 1e3,
        "spread": (max(steady) - min(steady)) / med,
        "loss": loss,
        "graphs": int(counters["stats"]["unique_graphs"]),  # Dynamo's count: 0 means nothing was compiled
    }


def run(spec: str, mode: str, steps: int, nproc: int, cache: str) -> dict:
    keep = os.path.join(tempfile.gettempdir(), "ddpkit-bench-inductor")  # --cache keep: shared by modes
    with tempfile.TemporaryDirectory(prefix="ddpkit-inductor-") as tmp:
        env = {"TORCHINDUCTOR_CACHE_DIR": keep if cache == "keep" else tmp}
        if cache == "warm" and mode != "eager":
            ddpkit.spawn(body, nproc=nproc, args=(spec, mode, 1), threads=1, env=env, timeout=1200)
        before = os.getloadavg()[0]
        args = (spec, mode, steps)
        result = ddpkit.spawn(body, nproc=nproc, args=args, threads=1, env=env, timeout=1200)[0]
    return {
        "workload": spec,
        "mode": mode,
        "nproc": nproc,
        "cache": cache,
        **result,
        "load": [before, os.getloadavg()[0]],
        "torch": torch.__version__,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="cnn")
    p.add_argument("--modes", default="eager,inner,outer")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--cache", choices=("cold", "warm", "keep"), default="cold")
    ns = p.parse_args()
    for mode in ns.modes.split(","):
        print(json.dumps(run(ns.workload, mode, ns.steps, ns.nproc, ns.cache)), flush=True)


if __name__ == "__main__":
    main()
