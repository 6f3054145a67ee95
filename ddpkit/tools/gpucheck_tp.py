"""The GPU acceptance checks of tensor parallelism and of the CUDA-only paths around a step: TP over NCCL
(and FSDP x TP with 4 GPUs), async TP (torch's micro-pipelined TP, symmetric memory), the memory plan
against `torch.cuda.max_memory_allocated`, a real CUDA out-of-memory error survived, the profiler's CUDA
trace. Each takes a `Context` and returns one line, or raises `Skip` saying why it does not apply here
(on the CPU rehearsal: every one of them, each with its reason).

Tensor parallelism needs one GPU per rank: NCCL refuses two ranks on one device, and a tensor group of
one splits nothing, so on a single GPU the TP checks skip and say so.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import ddpkit
from ddpkit.strategy import TPOptions
from ddpkit.tools.gpucheck_checks import Context, Skip, clean_env, device

PLAN = {"up": "colwise", "down": "rowwise"}  # the Megatron pair: one all-reduce forward, one backward
STEPS, ROWS, WIDTH = 3, 16, 256
TOLERANCE = 1e-4  # relative, fp32 with TF32 off: the split sums in another order only


class Pair(nn.Module):
    """An MLP of one column-wise and one row-wise layer (TP's unit), with a sequence axis."""

    def __init__(self, d: int = WIDTH, hidden: int = 4 * WIDTH) -> None:
        super().__init__()
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def _cuda(why: str) -> None:
    if device() != "cuda":
        raise Skip(f"CUDA only (rehearsal on the CPU): {why}")


def _needs_gpus(ctx: Context, n: int, what: str) -> None:
    if ctx.gpus < n:
        raise Skip(
            f"{what} needs {n} GPUs, {ctx.gpus} visible: NCCL refuses two ranks on one device, and a "
            "tensor group of one GPU splits nothing"
        )


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(ROWS, 8, WIDTH, generator=g) for _ in range(STEPS)]


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float().cpu().clone()


def _train(options: TPOptions | None, compiled: bool = False) -> dict[str, Any]:
    """STEPS AdamW steps of the pair on the global batch split by the data-parallel rank (the tensor
    ranks of a group read the same rows); the whole weights after. `options` None: one process."""
    torch.backends.cuda.matmul.allow_tf32 = False
    session: dict[str, Any] = {"seed": 0, "verbose": False}
    if options is not None:
        session["strategy"] = options
    with ddpkit.session(**session) as s:
        model = s.model(Pair, strategy=options)
        if compiled:
            _async_setup()
        run = torch.compile(model) if compiled else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        layout = s.layout
        data = layout.data if layout is not None else 1
        rank = layout.data_rank(s.rank) if layout is not None else 0
        per = ROWS // data
        losses = []
        for x in _batches():
            mine = x[rank * per : (rank + 1) * per].to(s.device)
            with s.accumulate(model):
                loss = run(mine).square().mean()
                s.backward(loss)
            s.step(opt)
            losses.append(float(loss.detach()))
        out = {n: _full(p) for n, p in ddpkit.unwrap(model).named_parameters()}
        return {"weights": out, "losses": losses, "mesh": layout.describe() if layout else "one process"}


def _worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest relative difference over the tensors, and where."""
    rel = {n: float((a[n] - b[n]).norm() / b[n].norm().clamp_min(1e-12)) for n in b}
    where = max(rel, key=rel.__getitem__)
    return rel[where], where


def check_tp_nccl(ctx: Context) -> str:
    """TP(2) over NCCL matches one process; with 4 GPUs FSDP(2) x TP(2) too (needs 2 GPUs)."""
    _cuda("tensor parallelism over NCCL needs 2 GPUs")
    _needs_gpus(ctx, 2, "TP(2) over NCCL")
    ref = _train(None)
    lines = []
    shapes = [(2, TPOptions(tensor=2, plan=PLAN))]
    if ctx.gpus >= 4:
        shapes.append((4, TPOptions(tensor=2, plan=PLAN, min_block_params=1)))
    for nproc, options in shapes:
        got = ddpkit.spawn(_train, nproc=nproc, args=(options,), env={}, timeout=300)[0]
        worst, where = _worst(got["weights"], ref["weights"])
        assert worst <= TOLERANCE, f"{got['mesh']}: {where} {worst:.1e} from one process"
        lines.append(f"{got['mesh']}: worst {worst:.1e} ({where})")
    if ctx.gpus < 4:
        lines.append("FSDP(2) x TP(2) skipped: needs 4 GPUs")
    return "; ".join(lines)


def _async_setup() -> None:
    """Torch's async TP for the compiled model: symmetric memory on the tensor group (TP(2) on 2 ranks:
    the whole world) and inductor's micro-pipeline pass, which fuses each all-gather with the matmul
    after it and each matmul with the reduce-scatter after it."""
    import torch.distributed as dist
    from torch._inductor import config as inductor
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    world = dist.group.WORLD
    assert world is not None
    enable_symm_mem_for_group(world.group_name)
    inductor._micro_pipeline_tp = True


def _async_support() -> str | None:
    """Why torch here cannot run async TP, or None."""
    try:
        from torch._inductor import config as inductor
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group  # noqa: F401
    except ImportError as err:
        return f"torch {torch.__version__} has no symmetric memory ({err})"
    if not hasattr(inductor, "_micro_pipeline_tp"):
        return (
            f"torch {torch.__version__} has no micro-pipelined TP (torch._inductor.config._micro_pipeline_tp)"
        )
    return None


def check_tp_async(ctx: Context) -> str:
    """Async TP (torch's micro-pipelined TP on symmetric memory, compiled) matches eager TP(2)."""
    _cuda("async TP is CUDA's (symmetric memory over NVLink)")
    missing = _async_support()
    if missing:
        raise Skip(missing)
    _needs_gpus(ctx, 2, "async TP")
    eager = ddpkit.spawn(
        _train, nproc=2, args=(TPOptions(tensor=2, plan=PLAN, sequence_parallel=True),), env={}, timeout=300
    )[0]
    options = TPOptions(tensor=2, plan=PLAN, sequence_parallel=True)
    fused = ddpkit.spawn(_train, nproc=2, args=(options, True), env={}, timeout=600)[0]
    worst, where = _worst(fused["weights"], eager["weights"])
    assert worst <= TOLERANCE, f"async TP: {where} {worst:.1e} from eager TP"
    return f"compiled with _micro_pipeline_tp on symmetric memory: worst {worst:.1e} from eager TP ({where})"


# -- the memory plan against the allocator -------------------------------------------------------------
PLANNED = ("mlp", 4096)  # a named workload without attention (CUDA's fused attention keeps other tensors)


def _measured_peak() -> dict[str, int]:
    """One GPU, the planned step as plan --memory runs it (DDP's layout at world 1: AdamW, foreach on
    CUDA): the allocator's peak over the second (steady) step, from zero."""
    from ddpkit.tools import workloads

    wl = workloads.NAMED[PLANNED[0]]
    torch.manual_seed(0)
    model = wl.build().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    x, y = wl.sample(torch.Generator().manual_seed(0), PLANNED[1])
    batch = (x.cuda(), y.cuda())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # DDP's buckets hold the gradients from the wrap on, as planned
    for i in range(2):
        if i == 1:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        wl.step_loss(model, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    torch.cuda.synchronize()
    return {"peak": torch.cuda.max_memory_allocated(), "after": torch.cuda.memory_allocated()}


def check_plan_memory_cuda(ctx: Context) -> str:
    """`ddpkit plan --memory` of a step against `torch.cuda.max_memory_allocated` of that step."""
    _cuda("torch.cuda.max_memory_allocated is the CUDA caching allocator's")
    name, micro = PLANNED
    out = subprocess.run(
        [
            *(sys.executable, "-m", "ddpkit.cli", "plan", "--memory", "--model", name, "--world", "1"),
            *("--micro-batch", str(micro), "--global-batch", str(micro), "--device", "h100", "--json", "-"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=clean_env(),
        cwd=ctx.out,
    )
    assert out.returncode == 0, out.stderr[-400:]
    estimate = json.loads(out.stdout)["breakdown"]["peak"]  # the tracked peak: no allowance, no reserve
    measured = ddpkit.spawn(_measured_peak, nproc=1, env={}, timeout=300)[0]["peak"]
    error = estimate / measured - 1
    # cuBLAS's workspace and the allocator's 512-byte rounding are in the measure, not in the plan
    assert -0.15 <= error <= 0.10, f"plan {estimate / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB"
    mib = (estimate / 2**20, measured / 2**20)
    return f"{name} at micro-batch {micro}: plan {mib[0]:.1f} MiB, allocator {mib[1]:.1f} MiB ({error:+.1%})"


# -- a real out-of-memory error -------------------------------------------------------------------------
def _oom_rank(auto: bool) -> dict[str, Any]:
    """One GPU capped (set_per_process_memory_fraction) so that the model, its optimizer and half a
    micro-batch fit but a whole one does not: with micro_batch="auto" the step re-runs split."""
    from torch.utils.data import TensorDataset

    from ddpkit.errors import DdpkitError

    rows = 4096
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(2 * rows, 2048, generator=g), torch.randint(0, 10, (2 * rows,), generator=g)
    )
    with ddpkit.session(seed=0, verbose=False, micro_batch="auto" if auto else None, log_to=None) as s:
        model = s.model(nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(8)], nn.Linear(2048, 10)))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def loss(m: nn.Module, b: Any) -> torch.Tensor:
            return F.cross_entropy(m(b[0]), b[1])

        x, y = data[: rows // 2]
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss(model, (x.to(s.device), y.to(s.device))).backward()  # half a micro-batch: what it needs
        half = torch.cuda.max_memory_allocated() - base
        opt.zero_grad(set_to_none=False)
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, (base + 1.5 * half) / total))
        try:
            result = ddpkit.fit(
                s, model, opt, s.loader(data, batch_size=rows), loss, max_steps=2, progress=False, flops=None
            )
        except DdpkitError as err:
            return {"error": str(err)}
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)
        return {"steps": result.steps, "parts": s.stepper.oom.parts if s.stepper.oom else None}


def check_cuda_oom(ctx: Context) -> str:
    """A real CUDA out-of-memory error: one paragraph without the opt-in; re-run split with it."""
    _cuda("a CUDA out-of-memory error needs the CUDA caching allocator")
    plain = ddpkit.spawn(_oom_rank, nproc=1, args=(False,), env={}, timeout=300)[0]
    assert "ran out of memory" in plain.get("error", ""), plain
    auto = ddpkit.spawn(_oom_rank, nproc=1, args=(True,), env={}, timeout=300)[0]
    assert "error" not in auto and auto["steps"] == 2 and (auto["parts"] or 0) >= 2, auto
    return f"without the opt-in: one paragraph; micro_batch='auto': 2 steps, re-run as {auto['parts']} parts"


# -- the profiler's CUDA trace --------------------------------------------------------------------------
def _traced(directory: str) -> None:
    with ddpkit.session(
        seed=0, verbose=False, profile={"directory": directory, "wait": 1, "warmup": 1, "active": 2}
    ) as s:
        model = s.model(Pair)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for x in _batches() * 2:
            s.backward(model(x.to(s.device)).square().mean())
            s.step(opt)


def check_cuda_trace(ctx: Context) -> str:
    """session(profile=...) on the GPU writes a trace with CUDA kernels (the profiler's CUDA activity)."""
    _cuda("a CUDA trace records the GPU's kernels")
    directory = ctx.out / "cuda-trace"
    ddpkit.spawn(_traced, nproc=1, args=(str(directory),), env={}, timeout=300)
    traces = sorted(directory.glob("rank0-step*.trace.json"))
    assert traces, f"no trace in {directory}"
    events = json.loads(traces[0].read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    assert kernels, f"{traces[0].name}: no CUDA kernel events"
    return f"{traces[0].name}: {len(events)} events, {len(kernels)} CUDA kernels"


CHECKS: dict[str, Callable[[Context], str]] = {
    "tp-nccl": check_tp_nccl,
    "tp-async": check_tp_async,
    "plan-memory-cuda": check_plan_memory_cuda,
    "cuda-oom": check_cuda_oom,
    "cuda-trace": check_cuda_trace,
}
