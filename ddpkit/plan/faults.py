"""The expected training time lost to faults at a scale, with disk checkpoints only and with memory
snapshots (`ddpkit.checkpoint.memory`): what the snapshots buy, before renting the devices (`ddpkit
plan`'s fault section: `add_arguments`, `section`, `table`).

    lost = expected_loss(FaultModel(devices=1024, step_s=6.6, state_bytes=84e9))
    lost.disk.share, lost.disk.interval_s      # disk only, saved every Young's interval
    lost.memory.share, lost.memory.every       # a snapshot every N steps (Young's N), disk kept for the rest

A first-order model: faults independent, at `rate` per device-hour (the job's rate = rate x devices);
every fault stops the whole job (ddpkit restarts every rank). Per unit of training time:
- disk only: lost = stall / I + job rate x (I / 2 + restart + read), with `stall` the training time a save
  costs, `I` the interval between saves (Young's sqrt(2 stall / job rate) unless given), `read` the
  state over the storage bandwidth.
- memory: lost = c / (N t) + job rate x (N t / 2 + t + restart) + the disk part at the rate of faults memory
  cannot survive (a host and its buddy lost within one re-replication window), with `t` the step time,
  `c` the seconds one snapshot costs and N Young's in steps (at least 1); the in-flight step is redone.
The default rate is Meta's Llama 3 405B training (Dubey et al. 2024, section 3.3.4): 419 unexpected
interruptions in 54 days on 16,384 H100 GPUs, 1.97e-5 per GPU-hour.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

LLAMA3_RATE = 419 / (54 * 24 * 16384)  # interruptions per GPU-hour
LLAMA3_SOURCE = "Llama 3 405B: 419 unexpected interruptions in 54 days on 16,384 GPUs (Dubey et al. 2024)"


@dataclass(frozen=True, kw_only=True)
class FaultModel:
    """The job, its faults and its storage; validated on construction."""

    devices: int
    step_s: float  # seconds per optimizer step at this scale
    state_bytes: float  # the whole training state (weights, optimizer), all ranks together
    rate: float = LLAMA3_RATE  # faults per device-hour
    devices_per_host: int = 8
    storage_bytes_per_s: float = 10e9  # to and from the checkpoint store, the whole job
    restart_s: float = 120.0  # a fault to every rank training again (the scheduler, the agent, imports)
    save_stall_s: float | None = None  # training time a disk save costs; None: a tenth of a write
    disk_interval_s: float | None = None  # None: Young's
    snapshot_s: float = 0.0  # training time one memory snapshot costs (about 0 behind a GPU's step)
    rereplicate_s: float = 60.0  # until a lost host's buddy copy exists again

    def __post_init__(self) -> None:
        for name in ("devices", "step_s", "state_bytes", "rate", "storage_bytes_per_s", "devices_per_host"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be positive")


@dataclass(frozen=True)
class Loss:
    share: float  # of training time lost to faults and to their protection
    interval_s: float  # between disk saves
    every: int = 0  # steps between memory snapshots (0: none)


@dataclass(frozen=True)
class FaultPlan:
    job_faults_per_hour: float
    disk: Loss
    memory: Loss


def young(cost_s: float, rate_per_s: float) -> float:
    """Young's optimal interval between checkpoints costing `cost_s` at `rate_per_s` faults."""
    return math.sqrt(2 * cost_s / rate_per_s) if cost_s > 0 else 0.0


def disk_share(rate_per_s: float, stall: float, interval: float, restart: float, read: float) -> float:
    return stall / interval + rate_per_s * (interval / 2 + restart + read)


def expected_loss(m: FaultModel) -> FaultPlan:
    job_rate = m.rate * m.devices / 3600  # faults per second of the whole job
    read = m.state_bytes / m.storage_bytes_per_s
    stall = m.save_stall_s if m.save_stall_s is not None else read / 10  # a background save
    interval = m.disk_interval_s or max(young(stall, job_rate), m.step_s)
    disk = Loss(disk_share(job_rate, stall, interval, m.restart_s, read), interval)
    hosts = max(1, m.devices // m.devices_per_host)
    both = job_rate * (job_rate / hosts) * m.rereplicate_s if hosts > 1 else 0.0  # a host and its buddy
    rare = max(young(stall, both) if both else math.inf, interval)  # disk: only what memory cannot survive
    every = max(1, round(young(m.snapshot_s, job_rate) / m.step_s)) if m.snapshot_s > 0 else 1
    snapshots = m.snapshot_s / (every * m.step_s) + job_rate * (every * m.step_s / 2 + m.step_s + m.restart_s)
    kept = stall / rare + both * (rare / 2 + m.restart_s + read) if math.isfinite(rare) else 0.0
    return FaultPlan(job_rate * 3600, disk, Loss(snapshots + kept, rare, every))


# -- `ddpkit plan`'s section --------------------------------------------------------------------------
OPTIONS = ("fault_rate", "restart_s", "storage_gbps", "disk_interval_s", "snapshot_cost", "optimizer_states")


def add_arguments(p: Any) -> None:
    """`ddpkit plan`'s fault flags (argparse)."""
    g = p.add_argument_group("faults (the expected time lost, disk checkpoints vs memory snapshots)")
    g.add_argument(
        "--fault-rate",
        type=float,
        default=LLAMA3_RATE,
        help=f"interruptions per GPU-hour (default {LLAMA3_RATE:.3g}: {LLAMA3_SOURCE})",
    )
    g.add_argument(
        "--restart-s", type=float, default=120.0, help="s from a fault to every rank training again"
    )
    g.add_argument("--storage-gbps", type=float, default=10.0, help="GB/s to the checkpoint store, whole job")
    g.add_argument(
        "--disk-interval-s", type=float, default=None, help="s between disk saves (default: Young's)"
    )
    g.add_argument(
        "--snapshot-cost",
        type=float,
        default=0.02,
        help="share of a step one memory snapshot costs (measured on CPU ranks: 2-10%%; a GPU's copy "
        "runs behind the step: near 0)",
    )
    g.add_argument(
        "--optimizer-states", type=int, default=2, help="tensors per parameter beside it (AdamW: 2)"
    )


def section(curve: list[dict[str, Any]], param_bytes: int, ns: Any, per_node: int) -> list[dict[str, Any]]:
    """One row per N of the plan, at its predicted step time: the share lost to faults each way."""
    state = param_bytes * (1 + ns.optimizer_states)
    out = []
    for row in curve:
        model = FaultModel(
            devices=row["n"],
            step_s=row["step_s"],
            state_bytes=state,
            rate=ns.fault_rate,
            devices_per_host=per_node,
            storage_bytes_per_s=ns.storage_gbps * 1e9,
            restart_s=ns.restart_s,
            disk_interval_s=ns.disk_interval_s,
            snapshot_s=ns.snapshot_cost * row["step_s"],
        )
        lost = expected_loss(model)
        out.append(
            {
                "n": row["n"],
                "faults_per_hour": lost.job_faults_per_hour,
                "disk_share": lost.disk.share,
                "disk_interval_s": lost.disk.interval_s,
                "memory_share": lost.memory.share,
                "memory_every": lost.memory.every,
            }
        )
    return out


def table(rows: list[dict[str, Any]], options: dict[str, Any]) -> list[str]:
    """The section as lines of text; `options`: the flags of `OPTIONS` as given."""
    from ddpkit.bench.report import table as grid

    ns = SimpleNamespace(**options)
    lines = [
        f"time lost to faults at {ns.fault_rate:.3g} interruptions per GPU-hour, a {ns.restart_s:g} s "
        f"restart, {ns.storage_gbps:g} GB/s storage, snapshots at {ns.snapshot_cost:.0%} of a step:",
        grid(
            ["N", "faults / day", "disk only: lost", "saved every", "memory snapshots: lost", "every"],
            [
                [
                    r["n"],
                    f"{r['faults_per_hour'] * 24:.3g}",
                    f"{r['disk_share']:.2%}",
                    _duration(r["disk_interval_s"]),
                    f"{r['memory_share']:.2%}",
                    f"{r['memory_every']} step(s)",
                ]
                for r in rows
            ],
        ),
        "  disk only: a fault costs half the save interval, the restart and the read; memory snapshots",
        "  (s.load(..., memory=N)): the step in flight and the restart, disk kept for what memory cannot",
        f"  survive. The default rate: {LLAMA3_SOURCE}.",
    ]
    return lines


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"
