"""ddpkit: data-parallel PyTorch on one CPU, one GPU, many GPUs or many machines, without the traps.

    with ddpkit.session(seed=0) as s:
        model = s.model(Net())
        loader = s.loader(dataset, batch_size=64, shuffle=True)   # 64 = global batch
        ...

Launch with `ddpkit run --nproc 2 train.py`, plain `torchrun`, or `python train.py`.
Tools live in subpackages imported on demand: `ddpkit.verify`, `ddpkit.bench`, `ddpkit.trace`.
"""

from ddpkit.checkpoint_files import CheckpointError
from ddpkit.errors import DdpkitError
from ddpkit.fit import Callback, FitResult, FitState, evaluate, fit
from ddpkit.metrics import Accuracy, Mean, MetricSet, Sum
from ddpkit.session import Session, seed_everything, session
from ddpkit.spawn import SpawnError, spawn
from ddpkit.stepping import StepInfo
from ddpkit.strategy import FSDPOptions
from ddpkit.topology import Hardware, Plan
from ddpkit.wrap import unwrap

__version__ = "0.1.0"

__all__ = [
    "Accuracy",
    "Callback",
    "CheckpointError",
    "DdpkitError",
    "FSDPOptions",
    "FitResult",
    "FitState",
    "Hardware",
    "Mean",
    "MetricSet",
    "Plan",
    "Session",
    "SpawnError",
    "StepInfo",
    "Sum",
    "__version__",
    "evaluate",
    "fit",
    "seed_everything",
    "session",
    "spawn",
    "unwrap",
]
