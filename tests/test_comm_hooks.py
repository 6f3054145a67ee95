"""Communication hooks by name on gloo: torch's fp16, bf16 and PowerSGD hooks, and what each costs in
accuracy against the exact gradient average."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ddpkit
from ddpkit.errors import DdpkitError
from ddpkit.parallel import comm_hooks

pytestmark = pytest.mark.numerics  # .ci/run runs these again under ATEN_CPU_CAPABILITY=default


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g)


def hook_error(name: str, steps: int) -> dict:
    """Train `steps` steps with hook `name`; at the last one, compare the averaged gradient with the exact one."""
    with ddpkit.session(seed=0, verbose=False) as s:
        net = _net()
        options = {"start_powerSGD_iter": 2} if name == "powersgd" else None
        model = s.model(net, comm_hook=name, comm_hook_options=options)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        losses = []
        for step in range(steps):
            x, y = _batch(s.rank, 0)  # the same batch each step: the loss must fall
            opt.zero_grad()
            exact = copy.deepcopy(ddpkit.unwrap(model))  # the same weights, outside DDP
            nn.functional.mse_loss(exact(x), y).backward()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            losses.append(s.all_reduce(loss.detach(), op="mean").item())
            if step == steps - 1:
                want = torch.cat([s.all_reduce(p.grad, op="mean").flatten() for p in exact.parameters()])
                got = torch.cat([p.grad.flatten() for p in model.parameters()])
            opt.step()
        rel = ((got - want).norm() / want.norm()).item()
        params = [p.detach().clone() for p in model.parameters()]
        return {"rel": rel, "losses": losses, "params": params}


@pytest.mark.parametrize(
    ("name", "low", "high"), [("fp16", 1e-6, 2e-3), ("bf16", 1e-4, 2e-2), ("powersgd", 1e-2, 3.0)]
)
def test_hooks_trade_accuracy_for_bytes_as_documented(name: str, low: float, high: float, pool2) -> None:
    r0, r1 = pool2.run(hook_error, name, 6)
    assert all(torch.equal(a, b) for a, b in zip(r0["params"], r1["params"], strict=True)), "replicas differ"
    assert low < r0["rel"] < high, f"{name}: relative gradient error {r0['rel']:.2e}"
    assert r0["losses"][-1] < r0["losses"][0], f"{name}: training did not progress"
    print(f"{name}: relative error of the averaged gradient {r0['rel']:.2e}")


def test_unknown_hook_names_the_known_ones() -> None:
    with pytest.raises(DdpkitError, match=r"comm_hook='int8' is not a known .* Use one of \['bf16', 'fp16'"):
        comm_hooks.resolve("int8")


def test_hooks_are_imported_only_when_asked_for(monkeypatch) -> None:
    assert all(isinstance(target, str) for target in comm_hooks.HOOKS.values())  # names, not imports
    assert comm_hooks.HOOKS["shm"].startswith("ddpkit.parallel.shm_hook:")
    monkeypatch.setitem(comm_hooks.HOOKS, "missing", "ddpkit.no_such_module:factory")
    with pytest.raises(DdpkitError, match=r"lives in ddpkit.no_such_module, which is not installed"):
        comm_hooks.resolve("missing")


def wrong_options() -> str:
    with ddpkit.session(verbose=False) as s:
        try:
            s.model(_net(), comm_hook="fp16", comm_hook_options={"rank": 2})
        except DdpkitError as exc:
            return str(exc)
        return "accepted"


def test_options_a_hook_does_not_take_are_refused(pool2) -> None:
    r0, _ = pool2.run(wrong_options)
    assert r0.startswith("comm_hook='fp16' does not accept the options ['rank']")


def test_one_process_ignores_the_hook_and_says_so(capsys) -> None:
    with ddpkit.session(env={}, hardware=ddpkit.Hardware(gpus=0, cpu_cores=2)) as s:
        model = s.model(_net(), comm_hook="fp16")
        assert not isinstance(model, nn.parallel.DistributedDataParallel)
    assert "comm_hook='fp16' has no effect with one process" in capsys.readouterr().out
