"""What ddpkit costs on one GPU: the same loop as plain PyTorch and through `ddpkit.session` (single-gpu).

    python benchmarks/gpu_overhead.py                          # cnn, mlp, gpt; fp32 and bf16; 7 rounds
    python benchmarks/gpu_overhead.py --workload mlp --rounds 9 --json runs/gpu-overhead.json
    python benchmarks/gpu_overhead.py --feed device --batches 300      # the step alone: data on the GPU
    python benchmarks/gpu_overhead.py --device cpu --workload mlp --rounds 1 --batches 2   # harness smoke

Without a CUDA device it prints "skipped: no CUDA device" and exits 0 (unless --device cpu is asked for:
a smoke run of the harness, not a GPU figure).

Plain side, as the PyTorch tutorial writes it: `model.to(device)`, a DataLoader with pin_memory and a
shuffle, `x.to(device, non_blocking=True)`, `torch.autocast` for bf16, `zero_grad/backward/step`. ddpkit
side: `ddpkit.session(precision=...)`, `s.model`, `s.loader`, `s.accumulate`, `s.backward`, `s.step`.
Same workload (ddpkit.tools.workloads, the global batch x --batch-scale, sized for a GPU), same data, in one
process. Both sides are rebuilt every round (a fresh model and optimizer), then timed:

- first step: from the first batch request to the end of the first optimizer step (cuda-synchronized);
  the CUDA context, cuBLAS/cuDNN handles and allocator are warmed once before any timing;
- steady step: one whole epoch after that first step, divided by its steps (synchronized at the end).

Rounds alternate the order (AB, BA, ...), so drift hits both sides alike; ratio = ddpkit / plain per
round, reported as median [min, max]. Goal: steady ratio <= 1.01.

--feed loader (the default) times the whole loop, DataLoader included; on small workloads that is host
work (per-sample indexing, collation, pinning; docs/gpu.md). --feed device puts every batch on the GPU
before the clock starts and both sides iterate the same list (ddpkit's side without `s.loader`), so the
ratio is what `s.accumulate` / `s.backward` / `s.step` add to a launch-bound step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch.utils.data import DataLoader

import ddpkit
from ddpkit.tools import workloads

Timed = tuple[float, float]  # (first step s, steady s/step)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, batches: Iterator[Any], step: Callable[[Any], None]) -> Timed:
    start = time.perf_counter()
    step(next(batches))
    _sync(device)
    first = time.perf_counter() - start
    start, n = time.perf_counter(), 0
    for batch in batches:
        step(batch)
        n += 1
    _sync(device)
    return first, (time.perf_counter() - start) / max(n, 1)


def plain_round(wl: workloads.Workload, data: Any, batch: int, device: torch.device, bf16: bool) -> Timed:
    """The hand-written loop."""
    torch.manual_seed(0)
    model = wl.build().to(device)
    opt = wl.optimizer(model.parameters())
    loader = (
        data
        if isinstance(data, list)
        else DataLoader(data, batch_size=batch, shuffle=True, pin_memory=device.type == "cuda")
    )
    cast: Callable[[], AbstractContextManager] = (
        (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if bf16 else nullcontext
    )

    def step(b: Any) -> None:
        x, y = (t.to(device, non_blocking=True) for t in b)
        with cast():
            out = model(x)
            loss = wl.loss(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return _timed(device, iter(loader), step)


def ddpkit_round(wl: workloads.Workload, data: Any, batch: int, device: torch.device, bf16: bool) -> Timed:
    """The same loop written with ddpkit (single-gpu mode: no process group, no DDP)."""
    with ddpkit.session(
        seed=0, env={}, verbose=False, device=device.type, precision="bf16" if bf16 else "32"
    ) as s:
        torch.manual_seed(0)
        model = s.model(wl.build())
        opt = wl.optimizer(model.parameters())
        loader = data if isinstance(data, list) else s.loader(data, batch_size=batch, shuffle=True)

        def step(b: Any) -> None:
            x, y = b
            with s.accumulate(model):
                out = model(x)
                s.backward(wl.loss(out.reshape(-1, out.shape[-1]), y.reshape(-1)))
            s.step(opt)

        return _timed(device, iter(loader), step)


def _ratio(a: list[float], b: list[float]) -> list[float]:
    r = [x / y for x, y in zip(a, b, strict=True)]
    return [statistics.median(r), min(r), max(r)]


def measure(
    spec: str, device: torch.device, rounds: int, scale: int, batches: int, bf16: bool, feed: str = "loader"
) -> dict:
    wl = workloads.load(spec)
    batch = wl.global_batch * scale
    x, y = wl.sample(torch.Generator().manual_seed(0), batch * batches)
    data: Any = torch.utils.data.TensorDataset(x, y)
    if feed == "device":  # one list of on-device batches, the same for both sides
        data = [(x[i : i + batch].to(device), y[i : i + batch].to(device)) for i in range(0, len(x), batch)]
    sides = {"plain": plain_round, "ddpkit": ddpkit_round}
    for fn in sides.values():  # warm-up: CUDA context, cuBLAS/cuDNN handles, allocator pools
        fn(wl, data, batch, device, bf16)
    times: dict[str, list[Timed]] = {name: [] for name in sides}
    for r in range(rounds):
        for name in list(sides) if r % 2 == 0 else list(sides)[::-1]:
            times[name].append(sides[name](wl, data, batch, device, bf16))
    first = {n: [t[0] for t in ts] for n, ts in times.items()}
    steady = {n: [t[1] for t in ts] for n, ts in times.items()}
    return {
        "batch": batch,
        "steps_per_round": batches,
        "plain_steady_ms": statistics.median(steady["plain"]) * 1e3,
        "ddpkit_steady_ms": statistics.median(steady["ddpkit"]) * 1e3,
        "steady_ratio": _ratio(steady["ddpkit"], steady["plain"]),
        "plain_first_ms": statistics.median(first["plain"]) * 1e3,
        "ddpkit_first_ms": statistics.median(first["ddpkit"]) * 1e3,
        "first_ratio": _ratio(first["ddpkit"], first["plain"]),
        "samples_s": {"first": first, "steady": steady},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="cnn,mlp,gpt")
    p.add_argument("--precision", default="32,bf16", help="comma-separated: 32, bf16")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--batch-scale", type=int, default=8, help="global batch x this (a GPU wants more)")
    p.add_argument("--batches", type=int, default=0, help="steps per round (default per workload)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: harness smoke run only")
    p.add_argument(
        "--feed",
        choices=("loader", "device"),
        default="loader",
        help="device: batches on the device before timing (the step's own overhead)",
    )
    p.add_argument("--json", default=None)
    ns = p.parse_args(argv)
    if ns.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu_overhead: skipped: no CUDA device (torch {torch.__version__}, no GPU visible)")
        return 0
    device = torch.device("cuda:0" if ns.device == "cuda" else "cpu")
    what = torch.cuda.get_device_name(0) if ns.device == "cuda" else "CPU SMOKE RUN (not a GPU figure)"
    print(
        f"gpu_overhead: {what}; torch {torch.__version__}, CUDA {torch.version.cuda}; load average "
        f"{os.getloadavg()[0]:.2f}; {ns.rounds} rounds, batch x{ns.batch_scale}, feed {ns.feed}",
        flush=True,
    )
    default_batches = {"cnn": 40, "mlp": 20, "gpt": 10}
    rows: dict[str, Any] = {}
    for spec in ns.workload.split(","):
        for precision in ns.precision.split(","):
            r = measure(
                spec,
                device,
                ns.rounds,
                ns.batch_scale,
                ns.batches or default_batches.get(spec, 20),
                bf16=precision == "bf16",
                feed=ns.feed,
            )
            rows[f"{spec}/{precision}"] = r
            s, f = r["steady_ratio"], r["first_ratio"]
            print(
                f"{spec:4s} {precision:4s} batch {r['batch']:5d}  "
                f"steady: plain {r['plain_steady_ms']:8.2f} ms  "
                f"ddpkit {r['ddpkit_steady_ms']:8.2f} ms  ratio {s[0]:.3f} [{s[1]:.3f}, {s[2]:.3f}]   "
                f"first step: plain {r['plain_first_ms']:8.1f} ms  ddpkit {r['ddpkit_first_ms']:8.1f} ms  "
                f"ratio {f[0]:.2f} [{f[1]:.2f}, {f[2]:.2f}]",
                flush=True,
            )
    for spec in ns.workload.split(","):
        if f"{spec}/32" in rows and f"{spec}/bf16" in rows:
            fp32, bf16 = rows[f"{spec}/32"], rows[f"{spec}/bf16"]
            print(
                f"{spec}: bf16 vs fp32 steady step through ddpkit: "
                f"{bf16['ddpkit_steady_ms'] / fp32['ddpkit_steady_ms']:.2f}x the fp32 time"
            )
    print(
        "ratio = ddpkit / plain PyTorch per round, median [min, max]; goal for the steady step <= 1.01. "
        f"Load average at end {os.getloadavg()[0]:.2f}"
    )
    if ns.json:
        os.makedirs(os.path.dirname(ns.json) or ".", exist_ok=True)
        with open(ns.json, "w") as fh:
            facts = {"device": what, "torch": torch.__version__, "cuda": torch.version.cuda, "rows": rows}
            json.dump(facts, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
