"""The checks `python -m ddpkit.tools.gpucheck` runs (`ddpkit.tools.gpucheck` says how, why): each takes a
`Context` and returns one line of detail, or raises `Skip` / any error. Written against ddpkit's public
API and CLI, like a user's script; ranks and CLI runs get fresh processes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.cluster import environments, topology
from ddpkit.errors import DdpkitError
from ddpkit.names import DEVICE_ENV, GPUCHECK_DEVICE_ENV, SHARE_GPU_ENV
from ddpkit.parallel.precision import PrecisionPlan


class Skip(Exception):
    """A check that does not apply here (the rehearsal on CPU, a second GPU missing)."""


def device() -> str:
    """ "cuda", or "cpu" for the rehearsal (DDPKIT_GPUCHECK_DEVICE=cpu)."""
    return os.environ.get(GPUCHECK_DEVICE_ENV, "cuda")


def cuda_only() -> None:
    if device() != "cuda":
        raise Skip("CUDA only (rehearsal on the CPU)")


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any launcher's variables, plus `extra`."""
    drop = {*environments.launcher_vars(os.environ), DEVICE_ENV, SHARE_GPU_ENV}  # one owner of the list
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return {**env, **extra}


def share_env() -> dict[str, str]:
    """Two ranks sharing the first visible GPU over gloo; plain gloo CPU ranks in the rehearsal."""
    if device() != "cuda":
        return {DEVICE_ENV: "cpu"}
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    return {SHARE_GPU_ENV: "1", "CUDA_VISIBLE_DEVICES": first}


# -- small models and data, importable by the ranks and by `ddpkit verify` -----------------------------
def verify_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 3))


def verify_data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())


def _bn_net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 3))


def _digest(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in ddpkit.unwrap(model).state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- the checks ------------------------------------------------------------------------------------
@dataclass
class Context:
    out: Path
    gpus: int


def check_auto_single_gpu(ctx: Context) -> str:
    """`auto` with one process: single-gpu, cuda:0, no process group, no DDP wrapper."""
    import torch.distributed as dist

    with ddpkit.session(env={}, verbose=False, device="auto" if device() == "cuda" else "cpu") as s:
        model = s.model(nn.Linear(4, 2))
        want = ("single-gpu", "cuda:0") if device() == "cuda" else ("single-cpu", "cpu")
        assert (s.plan.mode, str(s.device)) == want, f"plan {s.plan.describe()}"
        assert not dist.is_initialized(), "a process group was created for one process"
        assert isinstance(model, nn.Linear), f"model wrapped in {type(model).__name__}"
        assert model.weight.device.type == device()
        return s.plan.describe()


def check_demo(ctx: Context) -> str:
    """The demo (`python -m ddpkit.tools.demo`) trains on the GPU to at least 95% held-out accuracy."""
    env = clean_env(**({} if device() == "cuda" else {DEVICE_ENV: "cpu"}))
    argv = [sys.executable, "-m", "ddpkit.tools.demo", "--epochs", "12", "--out", str(ctx.out / "demo")]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    text = out.stdout + out.stderr
    assert out.returncode == 0, f"exit code {out.returncode}: {text.strip().splitlines()[-1:]}"
    mode = "single-gpu" if device() == "cuda" else "single-cpu"
    assert f"mode {mode}" in text, f"not {mode}: {text.splitlines()[:1]}"
    match = re.search(r"demo: ([\d.]+)% test accuracy in ([\d.]+) s", text)
    assert match, "no accuracy line in the demo's output"
    accuracy = float(match.group(1))
    assert accuracy >= 95.0, f"{accuracy:.2f}% < 95%"
    return f"{accuracy:.2f}% held-out accuracy in {float(match.group(2)):.1f} s ({mode})"


def _train_steps(
    s: ddpkit.Session, model: nn.Module, opt: torch.optim.Optimizer, steps: int, plant: int = -1
) -> list:
    """`steps` optimizer steps on fixed data; on step `plant` the loss is multiplied by inf."""
    g = torch.Generator().manual_seed(1 + s.rank)
    x, y = torch.randn(64, 8, generator=g).to(s.device), torch.randint(0, 3, (64,), generator=g).to(s.device)
    infos = []
    for step in range(steps):
        with s.accumulate(model):
            loss = F.cross_entropy(model(x), y)
            if step == plant:
                loss = loss * float("inf")
            s.backward(loss)
        infos.append(s.step(opt))
    return infos


def check_bf16(ctx: Context) -> str:
    """precision="bf16": matmuls run in bfloat16 under autocast, weights stay fp32, loss goes down."""
    with ddpkit.session(env={}, verbose=False, precision="bf16", device=device()) as s:
        net = s.model(nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 3)))
        with s.autocast():
            dtype = net(torch.randn(4, 8, device=s.device)).dtype
        assert dtype == torch.bfloat16, f"autocast output dtype {dtype}"
        assert s.precision.name == "bf16", s.precision.describe()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(0)
        x, y = (
            torch.randn(64, 8, generator=g).to(s.device),
            torch.randint(0, 3, (64,), generator=g).to(s.device),
        )
        losses = []
        for _ in range(20):
            with s.accumulate(net):
                loss = F.cross_entropy(net(x), y)
                s.backward(loss)
            s.step(opt)
            losses.append(loss.item())
        assert all(p.dtype == torch.float32 for p in net.parameters())
        assert losses[-1] < losses[0], f"loss {losses[0]:.3f} -> {losses[-1]:.3f}"
        return f"{s.precision.describe()}; loss {losses[0]:.3f} -> {losses[-1]:.3f} in 20 steps"


def _fp16() -> str | PrecisionPlan:
    return "16" if device() == "cuda" else PrecisionPlan("16", "cpu")


def check_fp16_scaler(ctx: Context) -> str:
    """precision="16": GradScaler; a planted inf step is skipped (weights unchanged) and counted."""
    with ddpkit.session(env={}, verbose=False, precision=_fp16(), device=device()) as s:
        net = s.model(nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 3)))
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        assert s.stepper.scaler is not None, "no gradient scaler for fp16"
        _train_steps(s, net, opt, 2)
        before, scale = _digest(net), s.stepper.scaler.get_scale()
        (info,) = _train_steps(s, net, opt, 1, plant=0)
        assert info.skipped, "the inf step was not skipped"
        assert _same(before, _digest(net)), "weights changed on the skipped step"
        assert s.skipped_steps >= 1, f"skipped_steps = {s.skipped_steps}"
        lowered = s.stepper.scaler.get_scale()
        assert lowered < scale, f"loss scale {scale} -> {lowered}"
        infos = _train_steps(s, net, opt, 2)
        assert not any(i.skipped for i in infos) and not _same(before, _digest(net)), "no update after it"
        return f"inf step skipped and counted ({s.skipped_steps}), loss scale {scale:g} -> {lowered:g}"


def check_syncbn_convert(ctx: Context) -> str:
    """torch's SyncBatchNorm conversion on CUDA: one process computes what BatchNorm computes."""
    cuda_only()
    torch.manual_seed(0)
    bn = _bn_net().cuda()
    sync = nn.SyncBatchNorm.convert_sync_batchnorm(_bn_net()).cuda()
    sync.load_state_dict(bn.state_dict())
    assert any(isinstance(m, nn.SyncBatchNorm) for m in sync.modules())
    x = torch.randn(32, 8, device="cuda")
    diff = (bn(x) - sync(x)).abs().max().item()
    assert diff < 1e-5, f"outputs differ by {diff:g}"
    return f"nn.SyncBatchNorm on cuda:0, outputs within {diff:.1e} of BatchNorm1d"


def check_checkpoint_devices(ctx: Context) -> str:
    """A checkpoint saved on the GPU loads on the CPU, and one saved on the CPU loads on the GPU."""
    root = ctx.out / "ckpt-devices"
    with ddpkit.session(env={}, verbose=False, device=device()) as s:
        net = s.model(_bn_net())
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        _train_steps(s, net, opt, 3)
        s.save(str(root / "gpu"), model=net, optimizer=opt, step=3)
        saved = _digest(net)
    with ddpkit.session(env={}, verbose=False, device="cpu") as s:
        net = s.model(_bn_net())
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        values = s.load(str(root / "gpu"), model=net, optimizer=opt, step=0)
        assert values["step"] == 3 and _same(saved, _digest(net)), "GPU checkpoint differs on the CPU"
        moments = [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t) and t.dim()]
        assert moments and all(t.device.type == "cpu" for t in moments), "optimizer state not on the CPU"
        _train_steps(s, net, opt, 1)
        s.save(str(root / "cpu"), model=net, optimizer=opt, step=4)
        saved = _digest(net)
    with ddpkit.session(env={}, verbose=False, device=device()) as s:
        net = s.model(_bn_net())
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        values = s.load(str(root / "cpu"), model=net, optimizer=opt, step=0)
        assert values["step"] == 4 and _same(saved, _digest(net)), "CPU checkpoint differs on the GPU"
        assert next(net.parameters()).device.type == device()
        _train_steps(s, net, opt, 1)  # the loaded optimizer state must be usable on this device
    return f"{device()} -> cpu -> {device()}: weights and AdamW state identical, training continues"


def _resume_rank(root: str, stop: int | None, steps: int) -> dict[str, torch.Tensor]:
    """One deterministic run: resume from `root` if it holds a checkpoint, stop and save after `stop`."""
    torch.use_deterministic_algorithms(True)
    with ddpkit.session(seed=0, verbose=False) as s:
        net = s.model(nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 3)))
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(7)
        x = torch.randn(384, 8, generator=g)
        loader = s.loader(
            TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()), batch_size=32, shuffle=True
        )
        values = s.load(root, model=net, optimizer=opt, loader=loader, step=0)
        step = values["step"]
        for _ in range(loader.epoch, 10):
            for xb, yb in loader:
                with s.accumulate(net):
                    s.backward(F.cross_entropy(net(xb), yb))
                s.step(opt)
                step += 1
                if step == stop:
                    s.save(root, model=net, optimizer=opt, loader=loader, step=step)
                    return {}
                if step == steps:
                    return _digest(net)
    return _digest(net)


def check_resume_bitwise(ctx: Context) -> str:
    """Deterministic algorithms on: stop mid-epoch, resume in a new process, end bitwise like one run."""
    env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", **({} if device() == "cuda" else {DEVICE_ENV: "cpu"})}
    full = ddpkit.spawn(_resume_rank, nproc=1, args=(str(ctx.out / "resume-full"), None, 30), env=env)[0]
    ddpkit.spawn(_resume_rank, nproc=1, args=(str(ctx.out / "resume"), 17, 30), env=env)
    resumed = ddpkit.spawn(_resume_rank, nproc=1, args=(str(ctx.out / "resume"), None, 30), env=env)[0]
    assert _same(full, resumed), "resumed weights differ from the uninterrupted run"
    return "stopped at step 17 (mid-epoch 1), resumed in a new process: 30 steps bitwise equal"


def _shared_rank(root: str) -> dict[str, Any]:
    """Two ranks on one GPU: DDP with device_ids, SyncBatchNorm, fp16 inf agreement, rank-0 checkpoint."""
    from torch.nn.parallel import DistributedDataParallel

    with ddpkit.session(seed=0, verbose=False, precision=_fp16()) as s:
        net = s.model(_bn_net(), sync_batchnorm=True)
        assert isinstance(net, DistributedDataParallel), type(net).__name__
        bn_type = next(type(m).__name__ for m in net.modules() if "BatchNorm" in type(m).__name__)
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        _train_steps(s, net, opt, 2)
        # the planted inf is on rank 1 only: both ranks must skip (the all-reduce spreads it)
        infos = _train_steps(s, net, opt, 1, plant=0 if s.rank == 1 else -1)
        infos += _train_steps(s, net, opt, 2)
        s.save(root, model=net, optimizer=opt)
        return {
            "rank": s.rank,
            "plan": s.plan.describe(),
            "backend": s.plan.backend,
            "device": str(s.device),
            "device_ids": net.device_ids,
            "bn": bn_type,
            "skipped": [i.skipped for i in infos],
            "weights": _digest(net),
        }


def check_shared_ddp(ctx: Context) -> str:
    """2 ranks sharing the GPU: DDP(device_ids), SyncBatchNorm, GradScaler inf agreement, rank-0 ckpt."""
    root = ctx.out / "shared-ckpt"
    r0, r1 = ddpkit.spawn(_shared_rank, nproc=2, args=(str(root),), env=share_env(), timeout=300)
    if device() == "cuda":
        assert (r0["backend"], r0["device"], r1["device"]) == ("gloo", "cuda:0", "cuda:0"), r0
        assert r0["device_ids"] == [0] and r0["bn"] == "SyncBatchNorm", (r0["device_ids"], r0["bn"])
    assert r0["skipped"] == r1["skipped"] == [True, False, False], (r0["skipped"], r1["skipped"])
    assert _same(r0["weights"], r1["weights"]), "replicas differ (weights or SyncBatchNorm statistics)"
    with ddpkit.session(env={}, verbose=False, device="cpu") as s:
        net = s.model(_bn_net())
        s.load(str(root), model=net)
        assert _same(r0["weights"], _digest(net)), "rank 0's checkpoint differs from the replicas"
    return f"{r0['plan']}; {r0['bn']}, inf on rank 1 skipped on both, replicas and checkpoint identical"


def _cli(ctx: Context, *args: str, env: dict[str, str] | None = None, timeout: float = 300) -> str:
    """Run `ddpkit ARGS` in a fresh process without launcher variables; return its stdout."""
    out = subprocess.run(
        [sys.executable, "-m", "ddpkit.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=clean_env(**(env or {})),
        cwd=ctx.out,
    )
    tail = " | ".join((out.stdout + out.stderr).strip().splitlines()[-3:])
    assert out.returncode == 0, f"`ddpkit {' '.join(args[:1])}` exit code {out.returncode}: {tail}"
    return out.stdout


def _verify(ctx: Context, env: dict[str, str], name: str) -> str:
    report = ctx.out / f"verify-{name}.json"
    here = "ddpkit.tools.gpucheck_checks"
    _cli(
        ctx,
        "verify",
        "--model",
        f"{here}:verify_model",
        "--data",
        f"{here}:verify_data",
        "--nproc",
        "2",
        "--device",
        device(),
        "--sync-batchnorm",
        "--steps",
        "5",
        "--json",
        str(report),
        env=env,
    )
    facts = json.loads(report.read_text())
    assert facts["passed"] and facts["replicas_identical"], facts.get("error")
    worst: dict[str, Any] = max(facts["tensors"], key=lambda r: r.get("rel_norm", 0.0), default={})
    return f"PASS over {len(facts['tensors'])} tensors, worst relative norm {worst.get('rel_norm', 0.0):.1e}"


def check_verify_shared(ctx: Context) -> str:
    """`ddpkit verify --nproc 2 --device cuda` on one GPU (shared): DDP(2) matches one process."""
    return "ranks sharing the GPU: " + _verify(ctx, share_env(), "shared")


def check_verify_nccl(ctx: Context) -> str:
    """`ddpkit verify --nproc 2 --device cuda` with NCCL, one GPU per rank (needs 2 GPUs)."""
    cuda_only()
    if ctx.gpus < 2:
        raise Skip("needs 2 GPUs for NCCL (one is covered by the shared check)")
    return "NCCL: " + _verify(ctx, {}, "nccl")


def check_trace(ctx: Context) -> str:
    """`ddpkit trace` on 2 ranks sharing the GPU writes a timeline with every bucket's all-reduce."""
    out = ctx.out / "trace"
    _cli(
        ctx, "trace", "--workload", "mlp", "--nproc", "2", "--steps", "2", "--out", str(out), env=share_env()
    )
    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    buckets = {e["name"] for e in events if "all-reduce" in str(e.get("name", ""))}
    assert buckets, "no all-reduce events in trace.json"
    return f"{len(events)} events, {len(buckets)} bucket all-reduce track(s) (wall-clock, not CUDA events)"


def check_doctor(ctx: Context) -> str:
    """`ddpkit doctor` names the GPU, NCCL and the mode, and its smoke test passes."""
    facts = json.loads(_cli(ctx, "doctor", "--json", timeout=180))
    if device() == "cuda":
        assert facts["gpus"], "no GPU reported"
        assert facts["backends"]["nccl"] and facts["nccl_version"], "NCCL not reported"
        assert "single-gpu" in (facts["plan"] or ""), facts["plan"]
    assert facts["healthy"], [x for x in facts["smoke"] if not x["ok"]]
    gpu = facts["gpus"][0] if facts["gpus"] else "no GPU"
    return (
        f"{gpu}, NCCL {facts['nccl_version']}, {facts['plan']}; smoke: {[x['name'] for x in facts['smoke']]}"
    )


def _rank_plan_error() -> str:
    with ddpkit.session(verbose=False):
        return "no error"


def check_cuda_errors(ctx: Context) -> str:
    """More processes than GPUs, and LOCAL_RANK beyond the visible GPUs: clear errors that name the fix."""
    cuda_only()
    hw = topology.Hardware.detect()
    n = hw.gpus + 1
    try:
        ddpkit.spawn(_rank_plan_error, nproc=n, env={}, timeout=120)
        raise AssertionError(f"{n} ranks on {hw.gpus} GPU(s) started without an error")
    except ddpkit.SpawnError as err:
        text = str(err)
        assert "NCCL needs one GPU per process" in text and f"--nproc {hw.gpus}" in text, text[-400:]
        assert "--share-gpu" in text and "--device cpu" in text, text[-400:]
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": str(hw.gpus), "LOCAL_WORLD_SIZE": str(n)}
    try:
        topology.resolve(env, hw, backend="gloo")
        raise AssertionError("LOCAL_RANK beyond the visible GPUs was accepted")
    except DdpkitError as err:
        assert "CUDA_VISIBLE_DEVICES" in str(err) and "--nproc auto" in str(err), str(err)
    return (
        f"{n} ranks on {hw.gpus} GPU(s), LOCAL_RANK {hw.gpus}: errors name --nproc, --share-gpu, --device cpu"
    )


CHECKS: dict[str, Callable[[Context], str]] = {
    "auto-single-gpu": check_auto_single_gpu,
    "demo": check_demo,
    "bf16": check_bf16,
    "fp16-scaler": check_fp16_scaler,
    "syncbn-convert": check_syncbn_convert,
    "checkpoint-devices": check_checkpoint_devices,
    "resume-bitwise": check_resume_bitwise,
    "shared-ddp": check_shared_ddp,
    "verify-shared": check_verify_shared,
    "verify-nccl": check_verify_nccl,
    "trace": check_trace,
    "doctor": check_doctor,
    "cuda-errors": check_cuda_errors,
}
