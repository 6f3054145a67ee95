"""The devices a memory plan can be asked about: their memory, what the runtime holds back, and the
allocator's allowance, each stated so a user can check and override it.

    devices.named("h100")            # H100 80 GB
    devices.named("cpu", world=4)    # this machine's CPU rank: its cgroup limit, else 1/4 of its memory
    devices.custom(24.0)             # --device-memory 24: 24 GB, a GPU's allowances

Why an allowance at all: the tracked peak (`ddpkit.plan.memory`) counts the bytes of live tensors,
while a device runs out when its allocator cannot find a block. CUDA's caching allocator rounds every
block up to 512 B, carves 2 MiB and 20 MiB segments and keeps freed blocks cached for reuse, so a
training step's reserved memory sits above its allocated peak (5-15 % is common; PyTorch's "Understanding
CUDA memory usage" shows the gap); glibc's malloc on a CPU rank keeps freed heap memory too. The
figures below are the allowances this plan adds on top of the tracked peak. On CPU ranks ddpkit's own
allocator policy (`ddpkit.step.cpu_allocator`: freed heap memory kept for the next step) can hold far
more than 10 %: docs/planning.md states what it measured (up to twice the tracked peak for a step
with 1.6 GB of logits); run such ranks with DDPKIT_CPU_ALLOCATOR=default, or plan with --device-memory
well above the estimate.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ddpkit.errors import problem
from ddpkit.observe.step_memory import CPU_ALLOWANCE, CPU_RESERVED, CUDA_ALLOWANCE, CUDA_RESERVED

GIB = 1 << 30
GB = 10**9


@dataclass(frozen=True, kw_only=True)
class Device:
    """One rank's device: `memory` bytes in all; `reserved` bytes the runtime keeps for itself (the
    CUDA context, NCCL's buffers) before the first tensor; `allowance` the allocator's fragmentation
    and caching, a fraction of the tracked peak."""

    name: str
    memory: int
    reserved: int
    allowance: float
    kind: str  # "cuda" or "cpu": the allocator the allowance describes
    source: str  # where the figures come from, printed with the plan

    def usable(self) -> int:
        """Bytes the tensors of a step may take, before the allowance (memory minus reserved)."""
        return self.memory - self.reserved


_GPUS: dict[str, tuple[str, int, str]] = {  # key: (name, total bytes as nvidia-smi reports them, source)
    "h100": ("H100 80 GB", 81559 << 20, "nvidia-smi: 81559 MiB (H100 SXM/PCIe 80 GB)"),
    "h200": ("H200 141 GB", 143771 << 20, "nvidia-smi: 143771 MiB"),
    "a100-80": ("A100 80 GB", 81920 << 20, "nvidia-smi: 81920 MiB"),
    "a100-40": ("A100 40 GB", 40960 << 20, "nvidia-smi: 40960 MiB"),
    "l4": ("L4 24 GB", 23034 << 20, "nvidia-smi: 23034 MiB"),
}
ALIASES = {
    "h100-80": "h100",
    "h100-80gb": "h100",
    "a100": "a100-80",
    "a100-80gb": "a100-80",
    "a100-40gb": "a100-40",
    "l4-24": "l4",
    "l4-24gb": "l4",
    "h200-141": "h200",
}
NAMES = (*_GPUS, "cpu")


def named(name: str, *, world: int = 1) -> Device:
    """A device by name (h100, h200, a100-80, a100-40, l4, cpu); `world` splits a CPU machine's memory."""
    key = ALIASES.get(name.lower(), name.lower())
    if key == "cpu":
        return cpu_rank(world)
    if key not in _GPUS:
        raise problem(
            f"device {name!r} is not known", f"Use one of {', '.join(NAMES)}, or --device-memory GB"
        )
    label, total, source = _GPUS[key]
    return Device(
        name=label, memory=total, reserved=CUDA_RESERVED, allowance=CUDA_ALLOWANCE, kind="cuda", source=source
    )


def custom(gb: float, *, kind: str = "cuda") -> Device:
    """`--device-memory GB`: a device of `gb` GB (10^9 bytes) with the allowances of its kind."""
    if gb <= 0:
        raise problem(f"--device-memory {gb} is not a positive number of GB", "Pass e.g. --device-memory 24")
    cuda = kind == "cuda"
    return Device(
        name=f"{gb:g} GB ({kind})",
        memory=int(gb * GB),
        reserved=CUDA_RESERVED if cuda else CPU_RESERVED,
        allowance=CUDA_ALLOWANCE if cuda else CPU_ALLOWANCE,
        kind=kind,
        source="--device-memory",
    )


def cpu_rank(world: int) -> Device:
    """One CPU rank of this machine: its cgroup limit when one is set (what the kernel enforces on a
    rank, `ddpkit.strategy.rank_memory`), else the machine's available memory split over `world` ranks."""
    from ddpkit.strategy import rank_memory

    limit = rank_memory.limit_bytes()
    if limit is not None:
        return Device(
            name="CPU rank (cgroup limit)",
            memory=limit,
            reserved=CPU_RESERVED,
            allowance=CPU_ALLOWANCE,
            kind="cpu",
            source="this process's cgroup memory limit",
        )
    available = _mem_available()
    share = available // max(1, world)
    return Device(
        name=f"CPU rank (1/{world} of this machine's available memory)",
        memory=share,
        reserved=CPU_RESERVED,
        allowance=CPU_ALLOWANCE,
        kind="cpu",
        source=f"/proc/meminfo MemAvailable {available / GIB:.1f} GiB / {world} rank(s)",
    )


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
