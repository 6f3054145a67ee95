"""torch.compile with FSDP: each block compiled in place before `fully_shard` (the torchtitan order)
trains like eager FSDP and like one process, the state dict keeps its names, and `verify --strategy
fsdp --compile` passes.

Compiling is slow on a small machine: one tiny model with two repeated blocks, 3 steps, the same graphs
in every test (Inductor's cache serves the repeats).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import REPO, run_cli
from safetensors import safe_open
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

import ddpkit
from ddpkit.parallel import compiling
from ddpkit.strategy.fsdp_options import FSDPOptions

pytestmark = pytest.mark.numerics  # compiled (Inductor) against eager kernels: a tolerance, not bits

HW = ddpkit.Hardware(gpus=0, cpu_cores=2)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.fc(x))


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), Block(), Block(), nn.Linear(16, 4))


def batches(rank: int, n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(rank)
    return [(torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(n)]


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 8, generator=g), torch.randint(0, 4, (64,), generator=g)
    return torch.utils.data.TensorDataset(x, y)


def train_fsdp(compile: bool, root: str) -> dict:
    """3 AdamW steps under FSDP (blocks: the two `Block`s); the full weights, keys and compile evidence."""
    from torch._dynamo.utils import counters

    with ddpkit.session(seed=0, verbose=compile) as s:
        torch._dynamo.reset()  # graphs from an earlier test in this rank would not be counted
        graphs = int(counters["stats"]["unique_graphs"])
        model = s.model(net, strategy=FSDPOptions(blocks=(Block,)), compile=compile)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        for x, y in batches(s.rank):
            s.backward(nn.functional.cross_entropy(model(x), y))
            s.step(opt)
        modules = dict(ddpkit.unwrap(model).named_modules())
        dcp = Path(s.save(root, model=model)) / "dcp"  # FSDP: a sharded (DCP) checkpoint
        saved_keys = sorted(FileSystemReader(str(dcp)).read_metadata().state_dict_metadata)
        s.export(f"{root}/model.safetensors", model)
        s.barrier()
        with safe_open(f"{root}/model.safetensors", "pt") as f:
            exported_keys = sorted(f.keys())
        weights = s.strategy.full_state(model)  # collective; whole tensors on rank 0
        fresh = s.model(net, strategy=FSDPOptions(blocks=(Block,)), compile=compile)
        s.load(root, model=fresh)  # the sharded checkpoint back into a (compiled) FSDP model
        reloaded = s.strategy.full_state(fresh)
        return {
            "weights": weights,
            "reloaded": all(torch.equal(weights[k], reloaded[k]) for k in weights),
            "compiled": sorted(n for n, m in modules.items() if compiling.is_compiled_in_place(m)),
            "graphs": int(counters["stats"]["unique_graphs"]) - graphs,
            "keys": sorted(model.state_dict()),  # FSDP's own (DTensor) names, as DCP checkpoints them
            "saved_keys": saved_keys,
            "exported_keys": exported_keys,
        }


def one_process() -> dict[str, torch.Tensor]:
    """The same 3 steps in one eager process on the global batch (both ranks' rows)."""
    with ddpkit.session(seed=0, verbose=False, env={}, hardware=HW) as s:
        model = s.model(net())
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        for (x0, y0), (x1, y1) in zip(batches(0), batches(1), strict=True):
            s.backward(nn.functional.cross_entropy(model(torch.cat([x0, x1])), torch.cat([y0, y1])))
            s.step(opt)
        return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.timeout(330)  # above the two pool runs' own limits (300 s), which fire first
def test_fsdp_compile_trains_like_eager_fsdp_and_one_process_with_the_same_names(pool2, tmp_path) -> None:
    eager = pool2.run(train_fsdp, False, str(tmp_path / "eager"), timeout=100)
    compiled = pool2.run(train_fsdp, True, str(tmp_path / "compiled"), timeout=200)
    assert compiled[0]["compiled"] == ["1", "2"] and eager[0]["compiled"] == []  # each Block, in place
    assert all(r["graphs"] > 0 for r in compiled), [r["graphs"] for r in compiled]  # compile was active
    assert compiled[0]["reloaded"] and eager[0]["reloaded"]  # s.load restores the saved weights exactly
    assert eager[0]["graphs"] == 0
    names = sorted(net().state_dict())
    for r in (*eager, *compiled):
        assert r["keys"] == names and r["exported_keys"] == names  # no `_orig_mod.` anywhere
        assert [k for k in r["saved_keys"] if k.startswith("model.")] == [f"model.{k}" for k in names]
    single = one_process()
    got, want = compiled[0]["weights"], eager[0]["weights"]
    assert sorted(got) == names
    for k in names:  # Inductor's fused kernels round differently from eager's: a tolerance, not bits
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got[k], single[k], rtol=1e-4, atol=1e-5)


@pytest.mark.timeout(260)  # above the subprocess's 240 s
def test_verify_strategy_fsdp_compile_on_the_command_line() -> None:
    args = ["--model", "test_fsdp_compile:net", "--data", "test_fsdp_compile:dataset", "--optimizer", "adamw"]
    args += ["--strategy", "fsdp", "--steps", "3", "--batch-size", "16", "--floor", "permuted", "--compile"]
    out = run_cli("verify", *args, "--json", "-", cwd=REPO / "tests", timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert '"compile": true' in out.stdout and '"strategy": "fsdp"' in out.stdout, out.stdout
    assert '"graphs_compiled": 0' not in out.stdout and '"graphs_compiled"' in out.stdout


def precompiled_refused() -> str:
    with ddpkit.session(seed=0, verbose=False) as s:
        try:
            s.model(torch.compile(net()), strategy="fsdp", compile=True)
        except ddpkit.DdpkitError as err:
            return str(err)
        return "accepted"


def test_fsdp_compile_refuses_a_module_compiled_already(pool2) -> None:
    for message in pool2.run(precompiled_refused, timeout=60):
        assert "already compiled (torch.compile(Sequential))" in message, message
        assert "Pass the uncompiled module" in message
