"""ddpkit: data-parallel PyTorch on one CPU, one GPU, many GPUs or many machines, without the traps.

    with ddpkit.session(seed=0) as s:
        model = s.model(Net())
        loader = s.loader(dataset, batch_size=64, shuffle=True)   # 64 = global batch
        ...

Launch with `ddpkit run --nproc 2 train.py`, plain `torchrun`, or `python train.py`.
"""

from ddpkit.errors import DdpkitError
from ddpkit.session import Session, seed_everything, session
from ddpkit.spawn import SpawnError, spawn
from ddpkit.topology import Hardware, Plan
from ddpkit.wrap import unwrap

__version__ = "0.1.0"

__all__ = [
    "DdpkitError",
    "Hardware",
    "Plan",
    "Session",
    "SpawnError",
    "__version__",
    "seed_everything",
    "session",
    "spawn",
    "unwrap",
]
