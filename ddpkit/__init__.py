"""ddpkit: data-parallel PyTorch on one CPU, one GPU, many GPUs or many machines, without the traps.

    with ddpkit.session(seed=0) as s:
        model = s.model(Net())
        loader = s.loader(dataset, batch_size=64, shuffle=True)   # 64 = global batch
        ...

Launch with `ddpkit run --nproc 2 train.py`, plain `torchrun`, or `python train.py`.
Tools live in subpackages imported on demand: `ddpkit.verify`, `ddpkit.bench`, `ddpkit.tools.trace`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ddpkit.checkpoint.files import CheckpointError
    from ddpkit.cluster.spawn import SpawnError, spawn
    from ddpkit.cluster.topology import Hardware, Placement
    from ddpkit.data import to_device
    from ddpkit.data.batching import Global
    from ddpkit.errors import DdpkitError
    from ddpkit.observe.metrics import Accuracy, Mean, MetricSet, Sum
    from ddpkit.observe.monitor import StepMonitor
    from ddpkit.parallel.modules import unwrap
    from ddpkit.parallel.shm_allreduce import ShmAllReduce
    from ddpkit.step.stepping import StepInfo
    from ddpkit.strategy import DDPOptions, FSDPOptions, HSDPOptions, TPOptions
    from ddpkit.training.fit import Callback, FitResult, FitState, evaluate, fit
    from ddpkit.training.opening import session
    from ddpkit.training.seeding import seed_everything
    from ddpkit.training.session import Session

# Imported on first use (PEP 562): `ddpkit run` and the tools then load only what they need, and the
# launcher process does not import the training modules it never runs.
_HOME = {
    "CheckpointError": "checkpoint.files",
    "DdpkitError": "errors",
    "Callback": "training.callbacks",
    "FitResult": "training.callbacks",
    "FitState": "training.callbacks",
    "evaluate": "training.fit",
    "fit": "training.fit",
    "Accuracy": "observe.metrics",
    "Mean": "observe.metrics",
    "MetricSet": "observe.metrics",
    "Sum": "observe.metrics",
    "StepMonitor": "observe.monitor",
    "Session": "training.session",
    "seed_everything": "training.seeding",
    "session": "training.opening",
    "SpawnError": "cluster.spawn",
    "spawn": "cluster.spawn",
    "StepInfo": "step.stepping",
    "DDPOptions": "strategy",
    "FSDPOptions": "strategy",
    "HSDPOptions": "strategy",
    "TPOptions": "strategy",
    "ShmAllReduce": "parallel.shm_allreduce",
    "to_device": "data",
    "Global": "data.batching",
    "Hardware": "cluster.topology",
    "Placement": "cluster.topology",
    "unwrap": "parallel.modules",
    "SpikeGuard": "step.spikes",
}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        value = getattr(importlib.import_module(f"ddpkit.{_HOME[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ddpkit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME))


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
    "Global",
    "HSDPOptions",
    "Hardware",
    "Mean",
    "MetricSet",
    "Placement",
    "Session",
    "ShmAllReduce",
    "SpawnError",
    "SpikeGuard",
    "StepInfo",
    "StepMonitor",
    "Sum",
    "TPOptions",
    "__version__",
    "evaluate",
    "fit",
    "seed_everything",
    "session",
    "spawn",
    "to_device",
    "unwrap",
]
