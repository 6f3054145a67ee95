"""Models and data for `ddpkit verify --bitwise` in tests/test_invariant.py (imported by module:function)."""

from __future__ import annotations

import torch
from torch import nn


class Noise(nn.Module):
    """Adds noise from a generator of its own: its draws depend on how many chunks this process ran."""

    def __init__(self) -> None:
        super().__init__()
        self.g = torch.Generator().manual_seed(7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0.01 * torch.randn(x.shape, generator=self.g)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 3))


def noisy() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), Noise(), nn.Linear(32, 3))


def batchnorm() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.Linear(32, 3))


def data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(3)
    return torch.utils.data.TensorDataset(
        torch.randn(128, 8, generator=g), torch.randint(0, 3, (128,), generator=g)
    )
