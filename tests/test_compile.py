"""torch.compile with ddpkit: both user orders give clean checkpoints, `s.model(compile=True)` trains like
eager DDP, the Inductor cache directory, and `verify --compile`.

Compiling is slow on a small machine, so one tiny model (the same graph everywhere, so Inductor's cache
serves every test after the first compilation) and, where only the wrappers matter (unwrap, checkpoint
keys, no_sync), torch.compile's "aot_eager" backend: Dynamo and AOTAutograd, no C++ compiler.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO, python
from safetensors import safe_open
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.bench import tune
from ddpkit.errors import DdpkitError
from ddpkit.parallel import compiling
from ddpkit.verify import VerifySpec, verify

pytestmark = pytest.mark.numerics  # .ci/run runs these again under ATEN_CPU_CAPABILITY=default

HW = ddpkit.Hardware(gpus=0, cpu_cores=2)
FAST = {"backend": "aot_eager"}  # the wrappers and autograd of torch.compile, without Inductor's C++


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def batches(rank: int, n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(rank)
    return [(torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(n)]


def build(s: ddpkit.Session, order: str) -> nn.Module:
    """The model as each way of writing it builds it."""
    if order == "compile-inside":  # torch's guidance: compile the module, then wrap it
        return s.model(torch.compile(net(), **FAST))
    if order == "compile-outside":  # compile whatever s.model returned (DDP at world > 1)
        return torch.compile(s.model(net()), **FAST)
    if order == "option":
        return s.model(net(), compile=FAST)
    if order == "inductor":
        return s.model(net(), compile=True)
    return s.model(net())


def train(s: ddpkit.Session, model: nn.Module, steps: int = 4, **step: object) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    for x, y in batches(s.rank, steps):
        with s.accumulate(model):
            s.backward(nn.functional.cross_entropy(model(x), y))
        s.step(opt, **step)


def save_train_resume(order: str, root: str, resume_order: str, env: dict | None = None) -> dict:
    with ddpkit.session(seed=0, verbose=False, env=env, hardware=HW if env is not None else None) as s:
        model = build(s, order)
        train(s, model)
        path = s.save(root, model=model)
        saved = {k: v.clone() for k, v in ddpkit.unwrap(model).state_dict().items()}
        fresh = build(s, resume_order)
        s.load(root, model=fresh)
        with safe_open(str(Path(path) / "model.safetensors"), "pt") as f:
            keys = sorted(f.keys())
        resumed = ddpkit.unwrap(fresh).state_dict()
        return {
            "keys": keys,
            "wrappers": [type(model).__name__, type(ddpkit.unwrap(model)).__name__],
            "resumed_equal": all(torch.equal(saved[k], resumed[k]) for k in saved),
            "forward": fresh(batches(0, 1)[0][0]).detach(),
        }


CLEAN = ["0.bias", "0.weight", "2.bias", "2.weight"]


@pytest.mark.parametrize(("order", "resume"), [("compile-inside", "plain"), ("compile-outside", "option")])
def test_both_orders_save_clean_keys_and_resume_at_world_1(order: str, resume: str, tmp_path: Path) -> None:
    out = save_train_resume(order, str(tmp_path), resume, env={})
    assert out["keys"] == CLEAN and out["wrappers"] == ["OptimizedModule", "Sequential"]
    assert out["resumed_equal"]


@pytest.mark.timeout(140)  # above the pool's 120 s
@pytest.mark.parametrize(("order", "resume"), [("compile-inside", "option"), ("compile-outside", "plain")])
def test_both_orders_save_clean_keys_and_resume_at_world_2(order: str, resume: str, tmp_path, pool2) -> None:
    ranks = pool2.run(save_train_resume, order, str(tmp_path), resume, timeout=120)
    outer = "OptimizedModule" if order == "compile-outside" else "DistributedDataParallel"
    for out in ranks:
        assert out["keys"] == CLEAN and out["wrappers"] == [outer, "Sequential"]
        assert out["resumed_equal"]
    assert torch.equal(ranks[0]["forward"], ranks[1]["forward"])  # replicas: identical by construction


def final_weights(order: str, accumulation: int, hook: str | None) -> dict:
    with ddpkit.session(seed=0, accumulation=accumulation, verbose=order == "inductor") as s:
        model = build(s, order) if hook is None else s.model(net(), comm_hook=hook, compile=True)
        with s.join(model):  # the compiled model's DDP is found for torch's Join too
            train(s, model, steps=2 * accumulation, max_norm=0.5)
        weights = {k: v.clone() for k, v in ddpkit.unwrap(model).state_dict().items()}
        inner = model.module if isinstance(model, DistributedDataParallel) else model
        return {"weights": weights, "wrappers": [type(model).__name__, type(inner).__name__]}


COMPILED_IN_DDP = ["DistributedDataParallel", "OptimizedModule"]  # DDP(torch.compile(net))


@pytest.mark.timeout(560)  # above the sum of the five pool runs' own limits (540 s), which fire first
def test_compile_option_trains_like_eager_ddp_with_accumulation_clipping_and_hooks(pool2) -> None:
    eager = pool2.run(final_weights, "plain", 2, None)[0]
    compiled = pool2.run(final_weights, "inductor", 2, None, timeout=180)
    outside = pool2.run(final_weights, "compile-outside", 2, None, timeout=120)[0]
    shm = pool2.run(final_weights, "inductor", 1, "shm", timeout=120)[0]
    shm_eager = pool2.run(final_weights, "plain", 1, None)[0]
    assert eager["wrappers"] == ["DistributedDataParallel", "Sequential"]
    assert compiled[0]["wrappers"] == COMPILED_IN_DDP and shm["wrappers"] == COMPILED_IN_DDP  # compiled
    assert outside["wrappers"][0] == "OptimizedModule"  # torch.compile(DDP(net))
    eager, shm_eager, outside, shm = (r["weights"] for r in (eager, shm_eager, outside, shm))
    compiled = [r["weights"] for r in compiled]
    assert all(torch.equal(compiled[0][k], compiled[1][k]) for k in eager)  # replicas identical
    for got, want in ((compiled[0], eager), (outside, eager), (shm, shm_eager)):
        for k in want:  # Inductor's fused kernels round differently from eager's: a tolerance, not bits
            torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5)


def test_unwrap_returns_the_module_through_nested_compile_wrappers() -> None:
    module = net()
    assert ddpkit.unwrap(torch.compile(module, **FAST)) is module
    assert ddpkit.unwrap(module) is module


def test_compile_options_are_checked_and_the_cache_directory_is_chosen() -> None:
    with pytest.raises(DdpkitError, match=r"keys torch.compile does not take: \['bogus'\]"):
        compiling.CompileOptions.parse({"bogus": 1})
    with pytest.raises(DdpkitError, match="neither True/False nor a dict"):
        compiling.CompileOptions.parse("yes")  # type: ignore[arg-type]
    assert compiling.CompileOptions.parse(False) is None
    assert compiling.cache_dir({"XDG_CACHE_HOME": "/c"}) == Path("/c/ddpkit/inductor")
    assert compiling.cache_dir({"TORCHINDUCTOR_CACHE_DIR": "/mine", "XDG_CACHE_HOME": "/c"}) == Path("/mine")
    torchs = {"TORCHINDUCTOR_CACHE_DIR": compiling.torch_default_cache_dir(), "XDG_CACHE_HOME": "/c"}
    assert compiling.cache_dir(torchs) == Path("/c/ddpkit/inductor")  # the value torch set is not the user's


# A process of its own, as a user's script starts: no earlier test can have set the variable (torch sets
# it at its first compilation, inside s.model(compile=...)). One forward without gradients: one graph for
# Inductor to compile into an empty cache (with a backward, a second graph and its C++ kernels: ~9 s).
CACHE_SCRIPT = """
import os, sys, torch, ddpkit
from torch import nn
backend = sys.argv[1]
with ddpkit.session(env={}, hardware=ddpkit.Hardware(gpus=0, cpu_cores=2)) as s:
    torch.manual_seed(0)
    model = s.model(nn.Sequential(nn.Linear(8, 4)), compile={"backend": backend})
    with torch.no_grad():
        model(torch.randn(2, 8))
    print("DURING", os.environ.get("TORCHINDUCTOR_CACHE_DIR"))
print("AFTER", os.environ.get("TORCHINDUCTOR_CACHE_DIR"))
"""


def _own_process(tmp_path: Path, backend: str, fresh: bool, **env: str) -> str:
    """CACHE_SCRIPT in a new interpreter (`fresh`), else forked by the suite's warm-start server (its
    environment is this request's; tests/conftest.py), with HOME in `tmp_path`; its stdout."""
    full = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "XDG_CACHE_HOME")}
    full.update(HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1", **env)
    script = tmp_path / "cache_script.py"
    script.write_text(CACHE_SCRIPT)
    out = subprocess.run(
        [sys.executable if fresh else python(), str(script), backend],
        capture_output=True,
        text=True,
        env=full,
        timeout=100,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


@pytest.mark.timeout(110)
def test_a_fresh_process_compiles_into_ddpkits_cache_directory(tmp_path: Path) -> None:
    # A new interpreter: in one forked from the warm server, which imported torch._dynamo, a value torch
    # wrote into the variable would be gone (the request's environment replaces the server's), and the
    # check that ddpkit never takes torch's own value for the user's would see nothing to check.
    out = _own_process(tmp_path, "inductor", fresh=True)
    mine = tmp_path / "home" / ".cache" / "ddpkit" / "inductor"
    assert f"Inductor cache {mine} (shared by the job's ranks, kept between runs)" in out, out
    assert f"DURING {mine}" in out and "(yours)" not in out
    assert any(p.is_file() for p in mine.rglob("*")), "Inductor wrote nothing into ddpkit's directory"
    assert "AFTER None" in out  # put back as it was before s.model (unset: torch sets it when it needs it)


@pytest.mark.timeout(110)
def test_a_cache_directory_set_before_start_is_kept_and_called_the_users(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"  # read when used: the warm server starts the process with it set
    out = _own_process(tmp_path, "aot_eager", fresh=False, TORCHINDUCTOR_CACHE_DIR=str(theirs))
    assert f"Inductor cache {theirs} (yours)" in out and f"DURING {theirs}" in out, out
    assert f"AFTER {theirs}" in out
    assert not (tmp_path / "home" / ".cache" / "ddpkit").exists()


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(128, 8, generator=g), torch.randint(0, 4, (128,), generator=g))


@pytest.mark.timeout(200)  # above the pool's 180 s, so the pool's message is the one seen
def test_verify_compile_matches_one_eager_process(pool2) -> None:
    spec = VerifySpec(
        model=net,
        data=dataset(),
        optimizer="adamw",
        steps=4,
        batch_size=16,
        compile=True,
        floor=("permuted",),
    )
    report = verify(spec, runner=functools.partial(pool2.run, timeout=180))
    assert report.passed, report.render()
    assert report.config["graphs_compiled"] > 0, report.render()  # the DDP side really ran compiled


def test_bench_tune_offers_compile() -> None:
    configs = tune.candidates(2, 2)
    assert any(c.compile for c in configs)


@pytest.mark.timeout(200)  # above the pool's 180 s, so the pool's message is the one seen
def test_verify_compile_flag_on_the_command_line(pool2, monkeypatch, capsys) -> None:
    # `ddpkit verify`'s own entry point (its parser, spec and JSON report) in this process, its DDP side on
    # the pool's ranks: a `ddpkit verify` command spawns two new interpreters (~10 s of CPU for imports).
    # The command itself, end to end, is test_fsdp_compile.py's `--strategy fsdp --compile`.
    from ddpkit.verify import cli

    monkeypatch.setattr(
        cli, "verify", lambda spec: verify(spec, runner=functools.partial(pool2.run, timeout=180))
    )
    monkeypatch.chdir(REPO / "tests")
    monkeypatch.setattr(sys, "path", list(sys.path))  # main() adds the folder it runs in
    args = ["--model", "test_compile:net", "--data", "test_compile:dataset", "--optimizer", "adamw"]
    args += ["--steps", "3", "--batch-size", "16", "--floor", "permuted", "--compile", "--json", "-"]
    code = cli.main(args)
    out = capsys.readouterr().out
    assert code == 0, out
    assert '"compile": true' in out
    assert '"graphs_compiled": 0' not in out and '"graphs_compiled"' in out


def _dynamo_off(fn: Callable[..., Any], spec: VerifySpec) -> Any:
    """On a pool rank: `fn(spec)` with Dynamo switched off, as TORCHDYNAMO_DISABLE=1 switches it off."""
    with torch._dynamo.config.patch(disable=True):
        return fn(spec)


@pytest.mark.timeout(200)  # above the pool's 180 s, so the pool's message is the one seen
def test_verify_compile_fails_when_nothing_was_compiled(pool2) -> None:
    """Dynamo switched off in the ranks: `--compile` would compare eager with eager, so it must fail.

    On the pool's ranks, Dynamo's switch (TORCHDYNAMO_DISABLE sets it as torch loads) turned off for the
    run: through `ddpkit verify` the variable made the command and both ranks new interpreters (~15 s of
    CPU for imports); the command line's plumbing of the verdict is test_verify.py's (exit 1)."""
    spec = VerifySpec(
        model=net,
        data=dataset(),
        optimizer="adamw",
        steps=2,
        batch_size=16,
        compile=True,
        floor=("permuted",),
    )
    report = verify(spec, runner=lambda fn, spec: pool2.run(_dynamo_off, fn, spec, timeout=180))
    said = report.render()
    assert not report.passed, said
    assert "[not_compiled]" in said and "compile: 0 graph(s)" in said, said
