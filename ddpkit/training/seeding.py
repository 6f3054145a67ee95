"""One seed for every generator a training script draws from.

Every rank starts from the same seed so models are initialised identically; the session then moves
each rank to a stream of its own (`Session.rank_seed`), so dropout and augmentation differ across ranks.
"""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed Python's, numpy's and torch's (CPU and CUDA) global generators."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
