"""When FSDP is the right choice: the replicated model state against one device's memory (pure)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddpkit.strategy.choice import FITS_SHARE, device_bytes, model_state_bytes, optimizer_slots, verdict


def test_model_state_counts_parameters_gradients_and_optimizer_state() -> None:
    net = nn.Linear(1000, 100)  # 100,100 fp32 parameters
    frozen = nn.Sequential(net, nn.Linear(100, 10).requires_grad_(False))
    assert model_state_bytes(net, optimizer_slots(torch.optim.AdamW)) == 100_100 * 4 * 4
    assert model_state_bytes(frozen, 2) == 100_100 * 4 * 4, "frozen parameters train no state"
    sgd = torch.optim.SGD(net.parameters(), lr=0.1)
    assert (
        optimizer_slots(sgd) == 0
        and optimizer_slots(torch.optim.SGD(net.parameters(), 0.1, momentum=0.9)) == 1
    )
    assert optimizer_slots(torch.optim.Adam(net.parameters())) == 2 and optimizer_slots(None) == 2


def test_adam_state_of_measured_mlp_matches_the_memory_benchmark() -> None:
    """docs/performance.md §7 measured 576.8 MiB of model state per DDP rank for the 37.8M-parameter MLP."""
    from ddpkit.tools import workloads

    mlp = workloads.load("mlp").build()
    assert model_state_bytes(mlp, 2) / 2**20 == pytest.approx(576.8, abs=0.1)


@pytest.mark.parametrize(
    ("state_gb", "device_gb", "fsdp"), [(10, 80, False), (63, 80, False), (65, 80, True)]
)
def test_fsdp_when_the_replicated_state_does_not_fit(state_gb: float, device_gb: float, fsdp: bool) -> None:
    v = verdict(int(state_gb * 1e9), int(device_gb * 1e9), world=8)
    assert v.fsdp is fsdp and (state_gb > FITS_SHARE * device_gb) is fsdp
    assert ("use strategy='fsdp'" in v.text) is fsdp and ("FSDP not needed" in v.text) is not fsdp
    if fsdp:
        assert f"{state_gb / 8:.2f} GB per rank at 8 ranks" in v.text


def test_cpu_ranks_share_the_machine_memory() -> None:
    whole = device_bytes(torch.device("cpu"))
    assert whole > 0 and device_bytes(torch.device("cpu"), 2) == whole // 2
