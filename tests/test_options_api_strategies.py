"""The effect of each option of the strategies, as a user sees it: DDP's keywords of `s.model` and the fields of
`DDPOptions` (given to `ddpkit.session`, so the session's options reach every model), FSDP's and HSDP's
fields (given to `s.model`, each model its own). Real gloo ranks from the shared pools; tests/options/api.toml
names these tests for the options no other test shows.
"""

from __future__ import annotations

import contextlib
import io
from typing import Any

import pytest
import torch
from torch import nn

import ddpkit
from ddpkit.strategy import DDPOptions, FSDPOptions
from ddpkit.strategy.hsdp_options import HSDPOptions

# -- DDP ----------------------------------------------------------------------------------------------------

CHANGED = {
    "find_unused_parameters": True,
    "bucket_cap_mb": 0.01,  # ~10 KB buckets: several for this net (25 MB: one)
    "gradient_as_bucket_view": False,
    "broadcast_buffers": False,
    "sync_batchnorm": True,
    "comm_hook": "powersgd",
    "comm_hook_options": {"matrix_approximation_rank": 3, "start_powerSGD_iter": 2},
}


class _Net(nn.Module):
    """A BatchNorm, a buffer of its own (`mark`) and a branch the forward never uses."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1, self.bn = nn.Linear(8, 64), nn.BatchNorm1d(64)
        self.lin2, self.lin3 = nn.Linear(64, 64), nn.Linear(64, 2)
        self.unused = nn.Linear(8, 2)
        self.register_buffer("mark", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin3(torch.tanh(self.lin2(self.bn(self.lin1(x)))))


def ddp_effects(where: str, options: dict[str, Any]) -> dict[str, Any]:
    """`options` as `s.model`'s keywords (where="model") or as `session(strategy=DDPOptions(...))`: what
    DDP does with them over two training steps, each rank on its own data."""
    given = {"strategy": DDPOptions(**options)} if where == "session" else {}
    with ddpkit.session(seed=0, verbose=False, **given) as s:
        model = s.model(_Net(), **(options if where == "model" else {}))
        inner = ddpkit.unwrap(model)
        with torch.no_grad():
            inner.mark.fill_(s.rank + 1.0)  # after DDP's start-up broadcast: each rank its own
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(s.rank)
        seen: dict[str, Any] = {}
        for step in range(2):  # the second forward refuses an unused parameter found_unused never saw
            x, y = torch.randn(16, 8, generator=g), torch.randint(0, 2, (16,), generator=g)
            loss = nn.functional.cross_entropy(model(x), y)
            if step == 0:
                seen["mark"] = float(inner.mark)  # broadcast_buffers: rank 0's mark, before the forward
            loss.backward()
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            seen["grad_storages"] = len({g.untyped_storage().data_ptr() for g in grads})
            seen["grads"] = len(grads)
            opt.step()
            opt.zero_grad(set_to_none=False)
        hooks = [state for _, state in model._comm_hooks]
        return {
            **seen,
            "steps": 2,
            "find_unused_parameters": model.find_unused_parameters,
            "static_graph": model.static_graph,
            "buckets": len(model._get_ddp_logging_data()["bucket_sizes"].split(",")),
            "syncbn": type(inner.bn).__name__,
            "hooks": [type(h).__name__ for h in hooks],
            "hook_rank": [getattr(h, "matrix_approximation_rank", None) for h in hooks],
        }


@pytest.mark.parametrize("where", ["session", "model"])
def test_ddp_options_reach_ddp_and_change_what_it_does(where: str, pool2) -> None:
    """Every DDP option changed from its default at once, as `DDPOptions` given to the session or as the
    keywords of `s.model`: each shows in what DDP does (its attributes, buckets, gradients, buffers)."""
    r0, r1 = pool2.run(ddp_effects, where, CHANGED, timeout=60)
    for r in (r0, r1):
        assert r["find_unused_parameters"] and r["steps"] == 2  # the unused branch did not stop step 2
        assert r["buckets"] >= 2, "bucket_cap_mb=0.01 did not reach DDP's buckets"
        assert r["grad_storages"] == r["grads"], "gradient_as_bucket_view=False: the grads are bucket views"
        assert r["syncbn"] == "SyncBatchNorm"
        assert r["hooks"] == ["PowerSGDState"] and r["hook_rank"] == [3]
    assert (r0["mark"], r1["mark"]) == (1.0, 2.0), "broadcast_buffers=False: rank 0's buffers were broadcast"
    static = pool2.run(ddp_effects, where, {"static_graph": True, "find_unused_parameters": True}, timeout=60)
    assert all(r["static_graph"] for r in static)
    plain = pool2.run(ddp_effects, where, {"find_unused_parameters": True}, timeout=60)
    for r in plain:  # the defaults, for contrast: one bucket, views, rank 0's buffers, no hook, not static
        assert r["buckets"] == 1 and r["grad_storages"] < r["grads"] and r["mark"] == 1.0
        assert r["hooks"] == [] and not r["static_graph"] and r["syncbn"] == "BatchNorm1d"


# -- FSDP and HSDP ------------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


def _blocks() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), Block(), Block(), nn.Linear(16, 2))


def _units(model: nn.Module) -> list[str]:
    return sorted(n for n, m in ddpkit.unwrap(model).named_modules() if type(m).__name__.startswith("FSDP"))


def sharded_effects(kind: str) -> dict[str, Any]:
    """Three models under FSDP ("fsdp", 2 ranks) or HSDP ("hsdp", 2 x 2 on 4): the session's options, every
    field changed, and min_block_params=1; their units, a block's weight after the forward, what was said."""
    cls = HSDPOptions if kind == "hsdp" else FSDPOptions
    degrees = {"replicate": 2, "shard": 2} if kind == "hsdp" else {}
    out = io.StringIO()
    session = cls(**degrees) if kind == "hsdp" else "fsdp"
    with contextlib.redirect_stdout(out), ddpkit.session(seed=0, strategy=session) as s:
        nets = [_blocks() for _ in range(3)]  # before s.model, from which on each rank draws its own numbers
        plain = s.model(nets[0])  # the session's strategy and options
        changed = cls(**degrees, blocks=(Block,), reshard_after_forward=False, cpu_offload=True, shm=False)
        chosen = s.model(nets[1], strategy=changed)
        small = s.model(nets[2], strategy=cls(**degrees, min_block_params=1))
        after_forward = {}
        for name, model in (("plain", plain), ("chosen", chosen)):
            loss = model(torch.randn(4, 8)).sum()
            after_forward[name] = type(
                ddpkit.unwrap(model)[1].lin.weight
            ).__name__  # a block's, not the root's
            loss.backward()
        return {
            "strategy": s.strategy.name,
            "units": {"plain": _units(plain), "chosen": _units(chosen), "small": _units(small)},
            "after_forward": after_forward,
            "said": out.getvalue(),
        }


@pytest.mark.parametrize("kind", ["fsdp", "hsdp"])
def test_fsdp_and_hsdp_options_change_the_units_the_reshard_and_what_is_said(kind: str, pool2, pool4) -> None:
    """blocks: the Blocks become units; min_block_params=1: every Linear; reshard_after_forward=False: a
    block's weight stays gathered (not a DTensor) between its forward and backward; cpu_offload on CPU ranks
    and shm=False: said once (offload changes nothing there; the collectives stay on gloo)."""
    results = (pool4 if kind == "hsdp" else pool2).run(sharded_effects, kind, timeout=120)
    for r in results:
        assert r["strategy"] == kind
        assert r["units"]["plain"] == [""], r["units"]  # the root only: the net is below 1M parameters
        assert r["units"]["chosen"] == ["", "1", "2"], r["units"]
        assert r["units"]["small"] == ["", "0", "1.lin", "2.lin", "3"], r["units"]
        assert r["after_forward"] == {"plain": "DTensor", "chosen": "Parameter"}, r["after_forward"]
    said = results[0]["said"]
    assert "cpu_offload=True changes nothing on CPU ranks" in said, said
    if kind == "fsdp":
        assert "FSDP2 collectives over gloo (FSDPOptions(shm=False))" in said, said
    else:  # under HSDP the collectives are gloo's unless shm=True (tests/test_fixes_hsdp_shm.py)
        assert said.count("HSDP collectives over gloo (HSDPOptions(shm=True): shard groups through") == 3, (
            said
        )
