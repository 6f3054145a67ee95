"""Model FLOPs per step, achieved FLOP/s and MFU (model FLOPs utilisation) against the device's peak.

FLOPs are counted once, by running one real micro-batch (forward and backward) under
`torch.utils.flop_counter.FlopCounterMode` (matmuls, convolutions, attention: the ops that dominate),
or given by the user. MFU = model FLOPs per second on one device / that device's peak: the "model"
FLOPs leave recomputation (activation checkpointing) out, as in PaLM's definition, so MFU does not
grow by redoing work.

Peaks: a table of vendor DENSE figures (no 2:4 sparsity) for known GPUs in bf16, fp16, tf32 and fp32
(`PEAKS`, sources below). On a CPU no such table is honest (the same model name runs at different
clocks and vector widths), so the peak is MEASURED: the best of a few large fp32 matmuls with this
process's threads, cached per machine in `cache_dir()` keyed by CPU model and thread count, and said
as "measured" wherever it is shown. An unknown GPU has no peak: FLOP/s are shown, MFU is not.
"""

from __future__ import annotations

import json
import os
import platform
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from ddpkit.names import CACHE_DIR_ENV

TERA = 1e12
# Dense tensor-core (and fp32 CUDA-core) peaks in TFLOP/s, from the vendors' datasheets:
#   H100 SXM / PCIe: https://www.nvidia.com/en-us/data-center/h100/ (bf16/fp16 1979 / 1513 "with
#     sparsity", dense half; tf32 989 / 756 sparse; fp32 67 / 51)
#   H200 SXM: https://www.nvidia.com/en-us/data-center/h200/ (same GH100 compute as H100 SXM)
#   A100 (SXM and PCIe): https://www.nvidia.com/en-us/data-center/a100/ (bf16/fp16 312, tf32 156, fp32 19.5)
#   L40S: https://www.nvidia.com/en-us/data-center/l40s/ (bf16/fp16 733 sparse -> 366, tf32 366 -> 183,
#     fp32 91.6)
#   L4: https://www.nvidia.com/en-us/data-center/l4/ (bf16/fp16 242 sparse -> 121, tf32 120 -> 60, fp32 30.3)
#   A10: https://www.nvidia.com/en-us/data-center/products/a10-gpu/ (bf16/fp16 125, tf32 62.5, fp32 31.2)
#   V100 SXM2: https://www.nvidia.com/en-us/data-center/v100/ (fp16 125, fp32 15.7; no bf16/tf32)
#   T4: https://www.nvidia.com/en-us/data-center/tesla-t4/ (fp16 65, fp32 8.1; no bf16/tf32)
# Matched in order against torch.cuda.get_device_name() (first substring that matches).
PEAKS: tuple[tuple[str, Mapping[str, float]], ...] = (
    ("H200", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("H100 PCIe", {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2}),
    ("H100", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("L40S", {"bf16": 366.0, "fp16": 366.0, "tf32": 183.0, "fp32": 91.6}),
    ("L4", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    ("A10", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    ("V100", {"fp16": 125.0, "fp32": 15.7}),
    ("T4", {"fp16": 65.0, "fp32": 8.1}),
)


@dataclass(frozen=True)
class Peak:
    """A device's peak FLOP/s for one number format, and where the figure comes from."""

    flops: float
    dtype: str  # "bf16", "fp16", "tf32", "fp32"
    source: str  # "NVIDIA H100 80GB HBM3 datasheet", "measured (Intel Xeon ..., 1 thread)"

    @property
    def measured(self) -> bool:
        return self.source.startswith("measured")


def gpu_peak(name: str, dtype: str) -> Peak | None:
    """The table's dense peak for a GPU named `name` in `dtype`; None for an unknown GPU or format."""
    for key, peaks in PEAKS:
        if key.lower() in name.lower():
            value = peaks.get(dtype)
            return None if value is None else Peak(value * TERA, dtype, f"{key} datasheet, dense")
    return None


def number_format(precision: str, device_type: str) -> str:
    """The format the matmuls run in: the precision plan's name, or tf32 when fp32 matmuls may use it."""
    if precision in ("bf16", "bf16-mixed", "bf16-true"):
        return "bf16"
    if precision in ("16", "16-mixed", "fp16"):
        return "fp16"
    if device_type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "fp32"


def cache_dir(env: Mapping[str, str] | None = None) -> str:
    """$DDPKIT_CACHE_DIR, else $XDG_CACHE_HOME/ddpkit, else ~/.cache/ddpkit."""
    env = os.environ if env is None else env
    if env.get(CACHE_DIR_ENV):
        return env[CACHE_DIR_ENV]
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ddpkit")


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else platform's description."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def measure_cpu_matmul(threads: int, *, size: int = 512, seconds: float = 0.3) -> float:
    """Best fp32 matmul FLOP/s over ~`seconds` with `threads` threads (the best: load only lowers it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        torch.mm(a, b)  # warm-up: allocation, the BLAS's thread pool
        best, deadline = 0.0, time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            for _ in range(4):
                torch.mm(a, b)
            best = max(best, 4 * 2 * size**3 / (time.perf_counter() - t0))
        return best
    finally:
        torch.set_num_threads(before)


def cpu_peak(
    threads: int | None = None,
    *,
    directory: str | None = None,
    measure: Callable[[int], float] = measure_cpu_matmul,
) -> Peak:
    """This machine's measured fp32 matmul peak for `threads` threads, from the cache or measured now."""
    threads = threads or torch.get_num_threads()
    model = cpu_model()
    key = f"{model} | {threads} threads | fp32"
    path = os.path.join(directory or cache_dir(), "cpu_peak.json")
    try:
        with open(path) as f:
            cached = json.load(f)
    except (OSError, ValueError):
        cached = {}
    if not isinstance(cached, dict):
        cached = {}
    value = cached.get(key)
    if not isinstance(value, (int, float)) or value <= 0:
        value = measure(threads)
        cached[key] = value
        try:  # a read-only home must not stop training: the peak is measured again next time
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(cached, f, indent=1)
            os.replace(tmp, path)
        except OSError:
            pass
    return Peak(
        float(value), "fp32", f"measured ({model}, {threads} thread(s), fp32 matmul; cached in {path})"
    )


def device_peak(device: torch.device, precision: str) -> Peak | None:
    """The peak for this device and precision: the GPU table, a measured CPU peak, or None."""
    if device.type == "cuda":
        return gpu_peak(torch.cuda.get_device_name(device), number_format(precision, "cuda"))
    if device.type == "cpu":
        return cpu_peak()
    return None


def count_flops(run: Callable[[], object]) -> int:
    """FLOPs of whatever `run()` computes (one micro-batch's forward and backward), counted by torch."""
    from torch.utils.flop_counter import FlopCounterMode

    with warnings.catch_warnings(), FlopCounterMode(display=False) as counter:
        # the counter's module tracker is a global module hook, which torch.compile warns about once
        warnings.filterwarnings(
            "ignore", message=r"Using `torch.compile\(module\)` when there are global hooks"
        )
        run()
    return int(counter.get_total_flops())


@dataclass(frozen=True)
class Utilisation:
    """Per device: model FLOPs per optimizer step, achieved FLOP/s over a window, MFU (None: no peak)."""

    flops_per_step: float
    achieved: float
    mfu: float | None

    def text(self) -> str:
        """For the progress line: "3.1 TFLOP/s, MFU 41%" (G or MFLOP/s below a tera; below 10%: 2 digits)."""
        scale, unit = next(
            ((f, u) for f, u in ((TERA, "T"), (1e9, "G"), (1e6, "M")) if self.achieved >= f), (1.0, "")
        )
        rate = f"{self.achieved / scale:.1f} {unit}FLOP/s"
        if self.mfu is None:
            return rate
        pct = self.mfu * 100
        return f"{rate}, MFU {pct:.0f}%" if pct >= 10 else f"{rate}, MFU {pct:.2g}%"

    def scalars(self) -> dict[str, float]:
        out = {"flops_per_step": self.flops_per_step, "tflops": self.achieved / TERA}
        if self.mfu is not None:
            out["mfu"] = self.mfu
        return out


def utilisation(flops_per_step: float, step_s: float, peak: Peak | None) -> Utilisation:
    achieved = flops_per_step / step_s if step_s > 0 else 0.0
    return Utilisation(flops_per_step, achieved, None if peak is None else achieved / peak.flops)
