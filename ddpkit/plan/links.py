"""Link models: latency α and bandwidth β per level (inside a node, between nodes), presets and a fit.

A level is described by what one collective step costs: α seconds of latency per step of the
algorithm, and β bytes per second that each rank can push through it (the bus bandwidth of
nccl-tests, which is what a ring sustains). Presets take the nominal rate from the hardware's
specification and assume that NCCL reaches `EFFICIENCY` of it; α is the order of NCCL's per-hop
latency for the transport. Both are stated as assumptions in every plan. `--link measured` replaces
guesses with a fit: α and β from the all-reduce times that `ddpkit bench collectives` measures on
this machine's ranks, one fit per world size.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ddpkit.errors import problem

GB = 1e9
EFFICIENCY = 0.8  # share of the nominal rate a tuned collective library reaches (assumption)
LAUNCH_S = 8e-6  # NCCL's base latency of a collective, ring/Simple 8.4 µs (src/graph/tuning.cc)
LAUNCH_SOURCE = "NCCL's base latency per collective, src/graph/tuning.cc"


@dataclass(frozen=True, kw_only=True)
class Level:
    """One level of the network: per-step latency α (s), per-rank bandwidth β (bytes/s), and where
    the numbers come from. `fits` holds measured (α, β) by world size, used in place of the pair."""

    name: str
    alpha_s: float
    beta_Bps: float
    source: str
    fits: dict[int, tuple[float, float]] = field(default_factory=dict)
    curves: dict[int, tuple[tuple[int, float], ...]] = field(default_factory=dict)  # n -> (bytes, s) measured

    def measured_allreduce(self, n: int, nbytes: float) -> float | None:
        """The measured all-reduce time at n ranks, linear between the measured sizes (beyond the largest:
        its time plus the fitted bandwidth's); None where n was not measured."""
        points = sorted(self.curves.get(n, ()))
        if len(points) < 2:
            return None
        if nbytes <= points[0][0]:
            return points[0][1]
        for (s0, t0), (s1, t1) in itertools.pairwise(points):
            if nbytes <= s1:
                return t0 + (t1 - t0) * (nbytes - s0) / (s1 - s0)
        s1, t1 = points[-1]
        return t1 + 2 * (n - 1) / n * (nbytes - s1) / self.at(n)[1]

    def at(self, n: int) -> tuple[float, float]:
        """(α, β) for a collective over n ranks: the fit at n, else the nearest measured n, else the pair."""
        if not self.fits:
            return self.alpha_s, self.beta_Bps
        nearest = min(self.fits, key=lambda k: (abs(k - n), -k))
        return self.fits[nearest]


@dataclass(frozen=True, kw_only=True)
class Link:
    """A cluster's links: `intra` between the devices of one node, `inter` between nodes (None: one
    node only), NICs per node, and whether the ranks share this machine's CPU cores with compute."""

    name: str
    intra: Level
    inter: Level | None = None
    nics_per_node: int = 1
    shares_cores: bool = False
    cores: int = 0  # with shares_cores: the cores the ranks share
    launch_s: float = 0.0  # fixed cost of every collective (a fit folds it into α)
    # "gloo" (CPU ranks): its reduce_scatter_tensor, which FSDP2 calls, is an all-reduce of the whole
    # input (benchmarks/hsdp_step.py: the same time, and the same bytes on the wire); "nccl": a ring.
    backend: str = "nccl"

    def describe(self) -> list[str]:
        lines = []
        for label, lv in (("intra-node", self.intra), ("inter-node", self.inter)):
            if lv is None:
                continue
            if lv.fits:
                fits = ", ".join(
                    f"n={n}: α {a * 1e6:.0f} µs, β {b / GB:.2f} GB/s" for n, (a, b) in sorted(lv.fits.items())
                )
                lines.append(f"{label}: {lv.name} (fitted: {fits}); {lv.source}")
            else:
                lines.append(
                    f"{label}: {lv.name}, α {lv.alpha_s * 1e6:.1f} µs per step, "
                    f"β {lv.beta_Bps / GB:.1f} GB/s per rank; {lv.source}"
                )
        if self.inter is not None:
            lines.append(f"{self.nics_per_node} NIC(s) per node; traffic between nodes shares them")
        if self.launch_s:
            lines.append(f"{self.launch_s * 1e6:g} µs per collective on top ({LAUNCH_SOURCE})")
        if self.backend == "gloo":
            lines.append(
                "gloo: a reduce-scatter costs an all-reduce of its whole input (gloo implements it as one)"
            )
        return lines


def _level(
    name: str, gbit_or_gbyte: float, unit: str, alpha_us: float, source: str, eff: float = EFFICIENCY
) -> Level:
    nominal = gbit_or_gbyte * (GB / 8 if unit == "Gb/s" else GB)
    return Level(
        name=name,
        alpha_s=alpha_us * 1e-6,
        beta_Bps=nominal * eff,
        source=f"{gbit_or_gbyte:g} {unit} per direction nominal ({source}) x {eff:.0%} reached (assumed); "
        f"α {alpha_us:g} µs per step (assumed, order of NCCL's per-hop latency)",
    )


LEVELS: dict[str, Level] = {
    "nvlink4": _level("NVLink 4", 450, "GB/s", 1.0, "NVIDIA H100 SXM datasheet: 900 GB/s total per GPU"),
    "nvlink3": _level("NVLink 3", 300, "GB/s", 1.0, "NVIDIA A100 SXM datasheet: 600 GB/s total per GPU"),
    "pcie5": _level("PCIe 5.0 x16", 63, "GB/s", 2.0, "PCI-SIG PCIe 5.0: 32 GT/s x 16 lanes"),
    "pcie4": _level("PCIe 4.0 x16", 31.5, "GB/s", 2.0, "PCI-SIG PCIe 4.0: 16 GT/s x 16 lanes"),
    "ib-ndr": _level("InfiniBand NDR", 400, "Gb/s", 5.0, "NVIDIA ConnectX-7 / Quantum-2: 400 Gb/s per port"),
    "ib-hdr": _level("InfiniBand HDR", 200, "Gb/s", 5.0, "NVIDIA ConnectX-6 / Quantum: 200 Gb/s per port"),
    "eth-100g": _level("100 GbE (TCP)", 100, "Gb/s", 25.0, "IEEE 802.3 100GBASE; NCCL socket transport", 0.7),
    "eth-25g": _level("25 GbE (TCP)", 25, "Gb/s", 25.0, "IEEE 802.3by 25GBASE; NCCL socket transport", 0.7),
}

# --link NAME: (intra-node level, inter-node level or None, NICs per node, what it describes)
PRESETS: dict[str, tuple[str, str | None, int, str]] = {
    "nvlink4": ("nvlink4", None, 0, "one node, GPUs on NVLink 4 (HGX H100)"),
    "nvlink3": ("nvlink3", None, 0, "one node, GPUs on NVLink 3 (HGX A100)"),
    "pcie5": ("pcie5", None, 0, "one node, GPUs on PCIe 5.0 only"),
    "pcie4": ("pcie4", None, 0, "one node, GPUs on PCIe 4.0 only"),
    "ib-ndr": (
        "nvlink4",
        "ib-ndr",
        8,
        "DGX H100-like: NVLink 4 inside, 8 x NDR 400 Gb/s (one per GPU) between",
    ),
    "ib-hdr": (
        "nvlink3",
        "ib-hdr",
        8,
        "DGX A100-like: NVLink 3 inside, 8 x HDR 200 Gb/s (one per GPU) between",
    ),
    "eth-100g": ("pcie4", "eth-100g", 1, "cloud nodes: PCIe 4.0 inside, one 100 GbE NIC per node"),
    "eth-25g": ("pcie4", "eth-25g", 1, "cloud nodes: PCIe 4.0 inside, one 25 GbE NIC per node"),
}


def preset(name: str, *, intra: str | None = None, nics_per_node: int | None = None) -> Link:
    """The named preset, optionally with another intra-node level or NIC count."""
    if name not in PRESETS:
        raise problem(
            f"--link {name!r} is not a known link", f"Use one of {sorted(PRESETS)} or measured[:FILE.json]"
        )
    intra_name, inter_name, nics, _ = PRESETS[name]
    intra_name = intra or intra_name
    if intra_name not in LEVELS:
        raise problem(f"--intra {intra_name!r} is not a known level", f"Use one of {sorted(LEVELS)}")
    return Link(
        name=name,
        intra=LEVELS[intra_name],
        inter=LEVELS[inter_name] if inter_name else None,
        nics_per_node=nics_per_node or max(1, nics),
        launch_s=LAUNCH_S,
    )


def fit_alpha_beta(points: Sequence[tuple[int, float]], n: int) -> tuple[float, float]:
    """Fit t = a + b·S to all-reduce times (bytes S, seconds t) at world size n, weighting each point
    by 1/t² (relative error, so small sizes pin the latency); return the ring's (α, β):
    a = 2(n-1)·α and b = 2(n-1)/n / β."""
    if n < 2 or len(points) < 2:
        raise problem(
            f"cannot fit a link from {len(points)} all-reduce size(s) at {n} rank(s)",
            "Measure at least two sizes with 2 or more ranks (ddpkit bench collectives)",
        )
    w = [1.0 / t**2 for _, t in points]
    sw = sum(w)
    mx = sum(wi * s for wi, (s, _) in zip(w, points, strict=True)) / sw
    my = sum(wi * t for wi, (_, t) in zip(w, points, strict=True)) / sw
    sxx = sum(wi * (s - mx) ** 2 for wi, (s, _) in zip(w, points, strict=True))
    sxy = sum(wi * (s - mx) * (t - my) for wi, (s, t) in zip(w, points, strict=True))
    b = max(sxy / sxx, 1e-15) if sxx > 0 else 1e-15
    a = max(my - b * mx, 0.0)
    return a / (2 * (n - 1)), 2 * (n - 1) / n / b


def from_collectives(data: dict[str, Any], *, source: str, cores: int) -> Link:
    """A one-node Link fitted from `ddpkit bench collectives` JSON (its all_reduce rows per world size)."""
    fits, curves = {}, {}
    for n_text, rows in data.get("worlds", {}).items():
        points = [(int(r["bytes"]), float(r["seconds"])) for r in rows if r["op"] == "all_reduce"]
        if int(n_text) >= 2 and len(points) >= 2:
            fits[int(n_text)] = fit_alpha_beta(points, int(n_text))
            curves[int(n_text)] = tuple(sorted(points))
    if not fits:
        raise problem(
            f"{source} has no all_reduce measurements at 2 or more ranks",
            "Run ddpkit bench collectives --ops all_reduce --nproc 2,4 and pass its collectives.json",
        )
    a, b = fits[min(fits)]
    level = Level(
        name="measured",
        alpha_s=a,
        beta_Bps=b,
        fits=fits,
        curves=curves,
        source=f"all_reduce times from ddpkit bench collectives ({source}): at a measured world size the "
        "measured curve is used (linear between sizes), elsewhere the fit",
    )
    cores = cores or data["machine"]["cores"]
    return Link(name="measured", intra=level, shares_cores=True, cores=cores, backend="gloo")


def two_level(rows: Sequence[dict[str, Any]], *, cores: int, per_node: int = 2) -> Link:
    """A two-node Link from measured all-reduce times (rows of `level`, `op`, `bytes`, `seconds`):
    `intra` among a node's `per_node` ranks (its curve kept, as `from_collectives` keeps one machine's),
    `inter_alone` between one rank per node (the inter-node level at 2 nodes, one NIC per node), as
    benchmarks/hsdp_step.py measures two hosts in network namespaces on this machine's shared cores."""

    def level(name: str, n: int, source: str) -> Level:
        points = sorted(
            (int(r["bytes"]), float(r["seconds"]))
            for r in rows
            if r["level"] == name and r["op"] == "all_reduce"
        )
        a, b = fit_alpha_beta(points, n)
        fits, curves = {n: (a, b)}, {n: tuple(points)}
        return Level(name=f"measured {name}", alpha_s=a, beta_Bps=b, fits=fits, curves=curves, source=source)

    intra = level("intra", per_node, f"gloo all_reduce among a node's {per_node} ranks, measured")
    inter = level("inter_alone", 2, "gloo all_reduce between one rank per node, measured")
    return Link(
        name="measured 2-level",
        intra=intra,
        inter=inter,
        nics_per_node=1,
        shares_cores=True,
        cores=cores,
        backend="gloo",
    )


def measure(counts: Sequence[int], *, threads: int = 1, max_size: str = "64MB", rounds: int = 3) -> Link:
    """Run `ddpkit bench collectives` (all_reduce only) at each world size in `counts`; fit the link."""
    from ddpkit.bench import collectives

    parser = argparse.ArgumentParser()
    collectives.add_arguments(parser)
    with tempfile.TemporaryDirectory(prefix="ddpkit-plan-") as out:
        ns = parser.parse_args(
            [
                "--nproc",
                ",".join(str(n) for n in counts),
                "--threads",
                str(threads),
                "--ops",
                "all_reduce",
                "--max-size",
                max_size,
                "--rounds",
                str(rounds),
                "--out",
                out,
            ]
        )
        collectives.run(ns)
        with open(os.path.join(out, "collectives.json")) as f:
            data = json.load(f)
    return from_collectives(data, source="measured now", cores=data["machine"]["cores"])


def load(
    spec: str,
    *,
    counts: Sequence[int],
    threads: int = 1,
    intra: str | None = None,
    nics_per_node: int | None = None,
) -> Link:
    """`--link` as given: a preset name, `measured` (measure now) or `measured:collectives.json` (or the
    JSON of benchmarks/hsdp_step.py: a two-level link, 2 ranks per node)."""
    if spec == "measured":
        return measure(sorted({n for n in counts if n >= 2}) or [2], threads=threads)
    if spec.startswith("measured:"):
        path = spec.partition(":")[2]
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError) as err:
            raise problem(
                f"cannot read {path!r} for --link measured: {err}",
                "Pass the collectives.json written by ddpkit bench collectives",
            ) from err
        if "links" in data:  # benchmarks/hsdp_step.py's output: two hosts, each level measured
            return two_level(data["links"], cores=data.get("cpus") or os.cpu_count() or 1)
        return from_collectives(data, source=path, cores=data.get("machine", {}).get("cores", 0))
    return preset(spec, intra=intra, nics_per_node=nics_per_node)


def with_cores(link: Link, cores: int) -> Link:
    return replace(link, cores=cores)


def log2_ceil(n: int) -> int:
    return max(0, math.ceil(math.log2(n))) if n > 1 else 0
