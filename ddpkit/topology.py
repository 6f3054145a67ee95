"""Pure resolution of "where am I running?" into a `Plan`.

Nothing here touches a process group, a GPU or `os.environ`: the functions take a mapping of
environment variables and a `Hardware` description, so every combination is a table test.

Launchers are detected in this priority order (first match wins):

1. torchrun / `ddpkit run` / any env:// launcher: RANK and WORLD_SIZE are set. torchrun inside
   `srun` also sets them, and its values are the ones the process group must use.
2. Slurm: SLURM_PROCID and SLURM_NTASKS > 1 (one task per process, `srun python train.py`),
   unless the job is an interactive shell (SLURM_JOB_NAME=bash), where the script runs alone.
3. Nothing: one process.

Then the device: an explicit `device=` wins (`ddpkit run --device cpu` passes it to every rank as
DDPKIT_DEVICE, read here when the script leaves device="auto"); otherwise no GPU means CPU (gloo
when world > 1), and a GPU means CUDA (NCCL when world > 1, device cuda:LOCAL_RANK).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from ddpkit.errors import problem

Mode = Literal["single-cpu", "single-gpu", "ddp-cpu", "ddp-gpu"]
DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("auto", "gloo", "nccl")


@dataclass(frozen=True)
class Hardware:
    """What this machine offers: visible GPUs and usable CPU cores."""

    gpus: int
    cpu_cores: int

    @staticmethod
    def detect() -> Hardware:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # macOS, Windows
            cores = os.cpu_count() or 1
        return Hardware(gpus=gpus, cpu_cores=max(1, cores))


@dataclass(frozen=True)
class Ranks:
    """Who this process is, as a launcher described it."""

    launcher: str  # "torchrun", "slurm" or "none"
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500


@dataclass(frozen=True)
class Plan:
    """The resolved decision: how this process trains. Printed once at start by global rank 0."""

    mode: Mode
    device: str  # "cpu" or "cuda:<local rank>"
    backend: str | None  # None when there is no process group (world size 1)
    ranks: Ranks

    @property
    def distributed(self) -> bool:
        return self.ranks.world_size > 1

    def describe(self) -> str:
        r = self.ranks
        comm = f"backend {self.backend}" if self.backend else "no process group"
        return f"mode {self.mode}, world size {r.world_size} ({r.launcher}), device {self.device}, {comm}"


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = env.get(name)
    if value is None or value == "":
        if default is None:
            raise problem(f"{name} is not set", "Launch with `ddpkit run` or torchrun, which set it")
        return default
    try:
        return int(value)
    except ValueError:
        raise problem(
            f"{name}={value!r} is not an integer",
            f"Unset {name} or set it to an integer",
            source="environment",
        ) from None


def first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm node list: "node[03-05,9],gpu1" -> "node03"."""
    match = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if not match:
        return "127.0.0.1"
    prefix, _, ranges = match.groups()
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def detect_ranks(env: Mapping[str, str]) -> Ranks:
    """Read the launcher's contract from `env` (see the module docstring for the order)."""
    if "RANK" in env and "WORLD_SIZE" in env:
        world = _int(env, "WORLD_SIZE")
        rank = _int(env, "RANK")
        local_world = _int(env, "LOCAL_WORLD_SIZE", world)
        ranks = Ranks(
            launcher="torchrun",
            rank=rank,
            world_size=world,
            local_rank=_int(env, "LOCAL_RANK", rank % max(local_world, 1)),
            local_world_size=local_world,
            node_rank=_int(env, "GROUP_RANK", rank // max(local_world, 1)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_int(env, "MASTER_PORT", 29500),
        )
    elif (
        "SLURM_PROCID" in env
        and _int(env, "SLURM_NTASKS", 1) > 1
        and env.get("SLURM_JOB_NAME") not in ("bash", "interactive")
    ):
        world = _int(env, "SLURM_NTASKS")
        nodes = _int(env, "SLURM_NNODES", 1)
        job_id = _int(env, "SLURM_JOB_ID", 0)
        ranks = Ranks(
            launcher="slurm",
            rank=_int(env, "SLURM_PROCID"),
            world_size=world,
            local_rank=_int(env, "SLURM_LOCALID", 0),
            local_world_size=max(1, world // max(nodes, 1)),
            node_rank=_int(env, "SLURM_NODEID", 0),
            master_addr=env.get("MASTER_ADDR") or first_slurm_host(env.get("SLURM_NODELIST", "")),
            # A port every task of the job derives identically, away from the well-known range.
            master_port=_int(env, "MASTER_PORT", 15000 + job_id % 20000),
        )
    else:
        return Ranks(launcher="none")
    _check_ranks(ranks)
    return ranks


def _check_ranks(r: Ranks) -> None:
    if r.world_size < 1:
        raise problem(f"world size {r.world_size} is below 1", "Set WORLD_SIZE to at least 1")
    if not 0 <= r.rank < r.world_size:
        raise problem(
            f"rank {r.rank} is outside world size {r.world_size}",
            "Each process needs a distinct rank in 0..WORLD_SIZE-1; let the launcher set it",
            source=r.launcher,
        )
    if not 0 <= r.local_rank < r.local_world_size:
        raise problem(
            f"local rank {r.local_rank} is outside local world size {r.local_world_size}",
            "Let the launcher set LOCAL_RANK and LOCAL_WORLD_SIZE",
            source=r.launcher,
        )


def resolve(
    env: Mapping[str, str], hardware: Hardware, *, device: str = "auto", backend: str = "auto"
) -> Plan:
    """Combine the launcher's ranks, the hardware and the user's overrides into a `Plan`."""
    if device == "auto":
        device = env.get("DDPKIT_DEVICE", "auto")
    if device not in DEVICES:
        raise problem(f"device={device!r} is not one of {DEVICES}", "Pass device='auto', 'cpu' or 'cuda'")
    if backend not in BACKENDS:
        raise problem(f"backend={backend!r} is not one of {BACKENDS}", "Pass 'auto', 'gloo' or 'nccl'")
    ranks = detect_ranks(env)
    use_gpu = hardware.gpus > 0 if device == "auto" else device == "cuda"
    if use_gpu and hardware.gpus == 0:
        raise problem(
            "device='cuda' was asked for but this machine has no visible GPU",
            "Pass device='cpu' (or --device cpu), or check CUDA_VISIBLE_DEVICES and the driver",
        )
    if backend == "nccl" and not use_gpu:
        raise problem(
            "backend 'nccl' needs GPUs but the plan runs on the CPU",
            "Use backend='gloo' (or 'auto') on CPU, or run on a machine with GPUs",
        )
    world = ranks.world_size
    if not use_gpu:
        return Plan(
            mode="ddp-cpu" if world > 1 else "single-cpu",
            device="cpu",
            backend=("gloo" if backend == "auto" else backend) if world > 1 else None,
            ranks=ranks,
        )
    if world > 1 and backend in ("auto", "nccl") and ranks.local_world_size > hardware.gpus:
        raise problem(
            f"{ranks.local_world_size} processes on this node (world size {world}) but only "
            f"{hardware.gpus} GPU(s): NCCL needs one GPU per process",
            f"Start at most {hardware.gpus} process(es) per node (--nproc {hardware.gpus} or "
            "--nproc auto), or pass --device cpu to train with gloo on the CPU",
            source=ranks.launcher,
        )
    if ranks.local_rank >= hardware.gpus:
        raise problem(
            f"LOCAL_RANK {ranks.local_rank} but only {hardware.gpus} GPU(s) are visible",
            "Start at most one process per GPU (--nproc auto), or check CUDA_VISIBLE_DEVICES",
            source=ranks.launcher,
        )
    return Plan(
        mode="ddp-gpu" if world > 1 else "single-gpu",
        device=f"cuda:{ranks.local_rank}",
        backend=("nccl" if backend == "auto" else backend) if world > 1 else None,
        ranks=ranks,
    )


def threads_per_process(cpu_cores: int, nproc: int) -> int:
    """CPU threads each of `nproc` local processes should use: the cores split evenly, at least 1."""
    return max(1, cpu_cores // max(1, nproc))
