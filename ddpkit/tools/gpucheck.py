"""`scripts/gpu-check.sh` / `python -m ddpkit.tools.gpucheck`: prove the CUDA paths on the GPU(s).

    scripts/gpu-check.sh                    # every check, one line each, then a summary; exit 0 = all pass
    python -m ddpkit.tools.gpucheck --only demo,fp16-scaler --keep runs/gpucheck
    python -m ddpkit.tools.gpucheck --list        # the checks, without running them

Without a CUDA device it prints "skipped: no CUDA device" and exits 0 (a CPU machine cannot fail it).
One GPU is enough: the multi-rank checks run two ranks on it with `share_gpu` (gloo for the CUDA
tensors; NCCL refuses two ranks on one device); with two or more GPUs NCCL is checked as well, and
tensor parallelism (TP(2) over NCCL, async TP; FSDP(2) x TP(2) with four): on one GPU those say they
skip and why (`ddpkit.tools.gpucheck_tp`, with the memory plan against `torch.cuda.max_memory_allocated`,
a real CUDA out-of-memory error, the profiler's CUDA trace).
Every check that needs a fresh process (deterministic cuBLAS, two ranks, the CLI) gets one through
`ddpkit.spawn` or a subprocess, so a failing check cannot poison the next. Budget: a few minutes.

Written against ddpkit's public API and CLI, like a user's script. DDPKIT_GPUCHECK_DEVICE=cpu rehearses
the harness on the CPU (the CUDA-only checks say "skip"): that is how its CPU-side tests run it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import ddpkit
from ddpkit.cluster import environments
from ddpkit.tools import gpucheck_checks, gpucheck_tp
from ddpkit.tools.gpucheck_checks import Context, Skip, device

CHECKS = {**gpucheck_checks.CHECKS, **gpucheck_tp.CHECKS}  # tensor parallelism's and the CUDA step's last

__all__ = ["CHECKS", "Context", "Skip", "header", "main", "run"]


def header() -> str:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (
        f"ddpkit {ddpkit.__version__}, torch {torch.__version__}, CUDA build {torch.version.cuda}, "
        f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} GPU(s): {gpu}"
    )


def run(names: list[str], out: Path) -> tuple[list[dict[str, Any]], bool]:
    ctx = Context(out=out, gpus=torch.cuda.device_count() if device() == "cuda" else 0)
    results = []
    for name in names:
        start = time.perf_counter()
        try:
            status, detail = "PASS", CHECKS[name](ctx)
        except Skip as why:
            status, detail = "SKIP", str(why)
        except Exception as err:  # every failure becomes one line; the summary counts it
            first = str(err).strip().splitlines()
            status, detail = "FAIL", f"{type(err).__name__}: {' '.join(first[-2:]) if first else ''}"[:400]
        seconds = time.perf_counter() - start
        print(f"{status:4s}  {name:20s} {seconds:6.1f} s  {detail}", flush=True)
        results.append({"check": name, "status": status, "seconds": round(seconds, 2), "detail": detail})
    return results, all(r["status"] != "FAIL" for r in results)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu-check", description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="", help="comma-separated check names (default: all)")
    p.add_argument("--list", action="store_true", help="list the checks and exit")
    p.add_argument("--keep", default=None, metavar="DIR", help="keep the checks' files here")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    ns = p.parse_args(argv)
    if ns.list:
        for name, fn in CHECKS.items():
            print(f"{name:20s} {(fn.__doc__ or '').splitlines()[0]}")
        return 0
    names = [n for n in ns.only.split(",") if n] or list(CHECKS)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        print(f"gpu-check: unknown check(s) {unknown}; --list shows them", file=sys.stderr)
        return 2
    if device() == "cuda" and not torch.cuda.is_available():
        why = "CUDA build, but no device visible" if torch.version.cuda else "CPU-only torch build"
        print(f"gpu-check: skipped: no CUDA device ({why}; torch {torch.__version__}). Nothing was checked.")
        return 0
    print(f"gpu-check: {header()}" + ("" if device() == "cuda" else " [REHEARSAL on the CPU]"), flush=True)
    print(f"gpu-check: launcher: {environments.describe(environments.detect(os.environ))}", flush=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ddpkit-gpucheck-") as tmp:
        out = Path(ns.keep or tmp).resolve()
        out.mkdir(parents=True, exist_ok=True)
        results, ok = run(names, out)
    counts = {s: sum(r["status"] == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    summary = (
        f"gpu-check: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped in "
        f"{time.perf_counter() - start:.0f} s: {'ALL PASS' if ok else 'FAILED'}"
    )
    print(summary)
    if ns.json:
        Path(ns.json).write_text(json.dumps({"header": header(), "results": results, "ok": ok}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
