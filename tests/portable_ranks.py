"""Rank functions for tests/test_checkpoint_portable.py: save under one strategy, load under another
(run in the shared rank pools, or in the test's own process as one process; importable by pickle)."""

from __future__ import annotations

import torch
from torch import nn

import ddpkit


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """The whole model and optimizer state keyed by parameter name, on CPU (any strategy)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    inner = ddpkit.unwrap(model)
    weights = get_model_state_dict(inner, options=options)
    optim = get_optimizer_state_dict(inner, opt, options=options)["state"]
    flat = {f"model/{k}": v for k, v in weights.items()}
    flat |= {f"optim/{p}/{k}": v for p, st in optim.items() for k, v in st.items()}
    return {k: v.detach().clone() for k, v in flat.items()}


def save(root: str, strategy: str, env: dict | None = None) -> dict:
    kwargs = {"env": env, "hardware": ddpkit.Hardware(gpus=0, cpu_cores=2)} if env is not None else {}
    with ddpkit.session(seed=0, verbose=False, strategy=strategy, **kwargs) as s:
        model = s.model(net())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(s.rank)
        for _ in range(2):
            s.backward(model(torch.randn(8, 16, generator=g)).square().mean())
            s.step(opt)
        s.save(root, model=model, optimizer=opt, step=2)
        return full_state(model, opt)


def load(root: str, strategy: str, env: dict | None = None, optimizer: bool = True) -> dict:
    kwargs = {"env": env, "hardware": ddpkit.Hardware(gpus=0, cpu_cores=2)} if env is not None else {}
    with ddpkit.session(seed=1, verbose=False, strategy=strategy, **kwargs) as s:
        torch.manual_seed(1)
        model = s.model(
            nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
        )
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        state = {"model": model, "optimizer": opt} if optimizer else {"model": model}
        values = s.load(root, **state, step=0)
        out = full_state(model, opt) if optimizer else {}
        if not optimizer:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            sd = get_model_state_dict(ddpkit.unwrap(model), options=StateDictOptions(full_state_dict=True))
            out = {f"model/{k}": v.detach().clone() for k, v in sd.items()}
        out["step"] = torch.tensor(values["step"])
        out["strategy"] = s.strategy.name  # type: ignore[assignment]
        return out
