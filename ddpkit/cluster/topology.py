"""Pure resolution of "where am I running?" into a `Placement`.

Nothing here touches a process group, a GPU or `os.environ`: the functions take a mapping of
environment variables and a `Hardware` description, so every combination is a table test.

Who this process is comes from the launcher's variables, read by one small detector per launcher
(`ddpkit.cluster.environments`: torchrun, Kubernetes PyTorchJob, env:// by hand, mpirun, srun, the sbatch
script itself, plain python), tried in a stated priority order.

Then the device: an explicit `device=` wins (`ddpkit run --device cpu` passes it to every rank as
DDPKIT_DEVICE, read here when the script leaves device="auto"); otherwise no GPU means CPU (gloo
when world > 1), and a GPU means CUDA (NCCL when world > 1, device cuda:LOCAL_RANK).

Sharing GPUs (`share_gpu=True`, `ddpkit run --share-gpu`, passed to the ranks as DDPKIT_SHARE_GPU=1):
for debugging multi-GPU code on fewer GPUs than ranks. Local ranks go to the visible GPUs round-robin
(cuda:LOCAL_RANK % GPUs) and talk through gloo, which all-reduces and broadcasts CUDA tensors (NCCL
refuses two ranks on one device: "Duplicate GPU detected"). The `ddp-gpu` code paths then run for
real (DDP with device_ids, CUDA buckets, torch's SyncBatchNorm): for correctness, not speed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from ddpkit.cluster import environments
from ddpkit.cluster.environments import RankEnv
from ddpkit.errors import problem
from ddpkit.names import DEVICE_ENV, SHARE_GPU_ENV

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
class Placement:
    """The resolved decision: how this process trains. Printed once at start by global rank 0."""

    mode: Mode
    device: str  # "cpu" or "cuda:<local rank>"
    backend: str | None  # None when there is no process group (world size 1)
    ranks: RankEnv
    notes: tuple[str, ...] = ()  # warnings to print once at start (global rank 0)
    shared_gpu: bool = False  # several local ranks on one GPU, over gloo (`share_gpu=True`)

    @property
    def distributed(self) -> bool:
        return self.ranks.world_size > 1

    def describe(self) -> str:
        r = self.ranks
        comm = f"backend {self.backend}" if self.backend else "no process group"
        if self.shared_gpu:
            comm += f", {r.local_world_size} local ranks sharing the GPU(s) round-robin"
        return f"mode {self.mode}, world size {r.world_size} ({r.launcher}), device {self.device}, {comm}"


def detect_ranks(env: Mapping[str, str], launcher: environments.Detector | None = None) -> RankEnv:
    """Read the launcher's contract from `env` (`ddpkit.cluster.environments`, first detector that
    answers; `launcher`, a detector of your own, first)."""
    ranks = environments.detect(env, () if launcher is None else (launcher,))
    _check_ranks(ranks)
    return ranks


def _check_ranks(r: RankEnv) -> None:
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
    env: Mapping[str, str],
    hardware: Hardware,
    *,
    device: str = "auto",
    backend: str = "auto",
    share_gpu: bool = False,
    launcher: environments.Detector | None = None,
) -> Placement:
    """Combine the launcher's ranks, the hardware and the user's overrides into a `Placement`."""
    if device == "auto":
        device = env.get(DEVICE_ENV, "auto")
    share_gpu = share_gpu or env.get(SHARE_GPU_ENV, "") not in ("", "0")
    if device not in DEVICES:
        raise problem(f"device={device!r} is not one of {DEVICES}", "Pass device='auto', 'cpu' or 'cuda'")
    if backend not in BACKENDS:
        raise problem(f"backend={backend!r} is not one of {BACKENDS}", "Pass 'auto', 'gloo' or 'nccl'")
    ranks = detect_ranks(env, launcher)
    notes: tuple[str, ...] = (ranks.note,) if ranks.note else ()
    use_gpu = hardware.gpus > 0 if device == "auto" else device == "cuda"
    if use_gpu and hardware.gpus == 0:
        raise problem(
            "device='cuda' was asked for but this machine has no visible GPU",
            "Pass device='cpu' (or --device cpu), or check CUDA_VISIBLE_DEVICES and the driver",
        )
    if share_gpu and not use_gpu:
        raise problem(
            "share_gpu=True (--share-gpu) puts ranks on a shared GPU, but this plan runs on the CPU ("
            + ("device='cpu' was asked for)" if device == "cpu" else "no visible GPU)"),
            "Drop --share-gpu / share_gpu=True: without a GPU the ranks train on the CPU with gloo",
        )
    if backend == "nccl" and not use_gpu:
        raise problem(
            "backend 'nccl' needs GPUs but the plan runs on the CPU",
            "Use backend='gloo' (or 'auto') on CPU, or run on a machine with GPUs",
        )
    world = ranks.world_size
    if not use_gpu:
        return Placement(
            mode="ddp-cpu" if world > 1 else "single-cpu",
            device="cpu",
            backend=("gloo" if backend == "auto" else backend) if world > 1 else None,
            ranks=ranks,
            notes=notes,
        )
    shared = share_gpu and world > 1 and ranks.local_world_size > hardware.gpus
    if shared:
        return _shared_plan(ranks, hardware, backend, notes)
    if share_gpu:
        notes += (
            f"share_gpu: {ranks.local_world_size} local rank(s) on {hardware.gpus} GPU(s), so every "
            "rank has a GPU of its own and nothing is shared",
        )
    if world > 1 and backend in ("auto", "nccl") and ranks.local_world_size > hardware.gpus:
        raise problem(
            f"{ranks.local_world_size} processes on this node (world size {world}) but only "
            f"{hardware.gpus} GPU(s): NCCL needs one GPU per process",
            f"Start at most {hardware.gpus} process(es) per node (--nproc {hardware.gpus} or "
            "--nproc auto), pass --share-gpu (session(share_gpu=True)) to let ranks share a GPU over gloo "
            "for debugging, or pass --device cpu to train with gloo on the CPU",
            source=ranks.launcher,
        )
    if ranks.local_rank >= hardware.gpus:
        raise problem(
            f"LOCAL_RANK {ranks.local_rank} but only {hardware.gpus} GPU(s) are visible",
            "Start at most one process per GPU (--nproc auto), check CUDA_VISIBLE_DEVICES (each rank "
            "must see all of this node's GPUs), or pass --share-gpu to place ranks on the GPUs round-robin",
            source=ranks.launcher,
        )
    return Placement(
        mode="ddp-gpu" if world > 1 else "single-gpu",
        device=f"cuda:{ranks.local_rank}",
        backend=("nccl" if backend == "auto" else backend) if world > 1 else None,
        ranks=ranks,
        notes=notes,
    )


def _shared_plan(ranks: RankEnv, hardware: Hardware, backend: str, notes: tuple[str, ...]) -> Placement:
    """More local ranks than GPUs, by request: round-robin placement, gloo for the CUDA tensors."""
    if backend == "nccl":
        raise problem(
            f"share_gpu puts {ranks.local_world_size} local ranks on {hardware.gpus} GPU(s), and NCCL "
            'refuses two ranks on one GPU ("Duplicate GPU detected")',
            "Leave backend='auto' (gloo, which handles CUDA tensors), or start one process per GPU",
            source=ranks.launcher,
        )
    per_gpu = -(-ranks.local_world_size // hardware.gpus)
    notes += (
        f"share_gpu: {ranks.local_world_size} local ranks share {hardware.gpus} GPU(s) (up to {per_gpu} "
        "per GPU, round-robin) and communicate through gloo: for checking multi-GPU code for "
        "correctness, not for speed",
    )
    return Placement(
        mode="ddp-gpu",
        device=f"cuda:{ranks.local_rank % hardware.gpus}",
        backend="gloo",
        ranks=ranks,
        notes=notes,
        shared_gpu=True,
    )


def threads_per_process(cpu_cores: int, nproc: int) -> int:
    """CPU threads each of `nproc` local processes should use: the cores split evenly, at least 1."""
    return max(1, cpu_cores // max(1, nproc))
