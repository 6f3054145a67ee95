"""ddpkit: data-parallel PyTorch on one CPU, one GPU, many GPUs or many machines, without the traps.

    with ddpkit.session(seed=0) as s:
        model = s.model(Net())
        loader = s.loader(dataset, batch_size=64, shuffle=True)   # 64 = global batch
        ...

Launch with `ddpkit run --nproc 2 train.py`, plain `torchrun`, or `python train.py`.
Tools live in subpackages imported on demand: `ddpkit.verify`, `ddpkit.bench`, `ddpkit.trace`.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ddpkit.checkpoint_files import CheckpointError
    from ddpkit.data import to_device
    from ddpkit.errors import DdpkitError
    from ddpkit.fit import Callback, FitResult, FitState, evaluate, fit
    from ddpkit.metrics import Accuracy, Mean, MetricSet, Sum
    from ddpkit.session import Session, seed_everything, session
    from ddpkit.shm_allreduce import ShmAllReduce
    from ddpkit.spawn import SpawnError, spawn
    from ddpkit.stepping import StepInfo
    from ddpkit.strategy import DDPOptions, FSDPOptions
    from ddpkit.topology import Hardware, Plan
    from ddpkit.wrap import unwrap

# Imported on first use (PEP 562): `ddpkit run` and the tools then load only what they need, and the
# launcher process does not import the training modules it never runs.
_HOME = {
    "CheckpointError": "checkpoint_files", "DdpkitError": "errors", "Callback": "fit", "FitResult": "fit",
    "FitState": "fit", "evaluate": "fit", "fit": "fit", "Accuracy": "metrics", "Mean": "metrics",
    "MetricSet": "metrics", "Sum": "metrics", "Session": "session", "seed_everything": "session",
    "session": "session", "SpawnError": "spawn", "spawn": "spawn", "StepInfo": "stepping",
    "DDPOptions": "strategy", "FSDPOptions": "strategy", "ShmAllReduce": "shm_allreduce", "to_device": "data",
    "Hardware": "topology", "Plan": "topology", "unwrap": "wrap",
}  # fmt: skip


def __getattr__(name: str) -> Any:
    if name in _HOME:
        value = getattr(importlib.import_module(f"ddpkit.{_HOME[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ddpkit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME))


class _Package(types.ModuleType):
    """`ddpkit.session`, `ddpkit.spawn` and `ddpkit.fit` stay the functions when the import system
    records the submodules of the same names on the package (it would replace the functions)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _HOME and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


__version__ = "0.1.0"

__all__ = [
    "Accuracy",
    "Callback",
    "CheckpointError",
    "DDPOptions",
    "DdpkitError",
    "FSDPOptions",
    "FitResult",
    "FitState",
    "Hardware",
    "Mean",
    "MetricSet",
    "Plan",
    "Session",
    "ShmAllReduce",
    "SpawnError",
    "StepInfo",
    "Sum",
    "__version__",
    "evaluate",
    "fit",
    "seed_everything",
    "session",
    "spawn",
    "to_device",
    "unwrap",
]
