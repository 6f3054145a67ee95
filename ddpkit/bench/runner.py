"""Timing training steps under many configurations, interleaved, on real ranks.

Every configuration with the same process count and threads runs inside one long-lived group of ranks
(`ddpkit.spawn`), one block after another: build the model, warm up, time `steps` steps, tear down.
`rounds` repeats the whole rotation, so slow drift of the machine (other users, thermal) hits every
configuration alike, and the spread across rounds is reported next to the median. Configurations that
need another process count (one process using all cores, nproc 1..N for scaling) run in their own
group, also once per round, in the same rotation.

Step time is the wall time of `steps` consecutive steps on global rank 0 divided by `steps`; the ranks
are in lockstep through the all-reduce, so rank 0's clock is the job's. On the CPU every kernel is
synchronous, so no device synchronisation is needed (on CUDA the block ends with a synchronize).
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from ddpkit.data import plan_batch
from ddpkit.names import CPU_ALLOCATOR_ENV

if TYPE_CHECKING:
    from ddpkit import Session

CPU_ALLOCATOR_OPT_OUT = CPU_ALLOCATOR_ENV  # the documented switch (README), as a user sets it

HOOKS = ("allreduce", "fp16", "bf16", "powersgd", "shm")
LOSSY_HOOKS = ("fp16", "bf16", "powersgd")


@dataclass(frozen=True, kw_only=True)
class Config:
    """One way to train the workload: processes, threads, DDP options, hook, optimizer sharding."""

    label: str
    nproc: int = 2
    threads: int = 1
    bucket_cap_mb: float | None = None  # None: DDP's 25 MB
    gradient_as_bucket_view: bool = False  # plain DDP's default; ddpkit's is True
    static_graph: bool = False
    hook: str = "allreduce"
    hook_options: dict[str, Any] = field(default_factory=dict)
    zero: bool = False  # torch's ZeroRedundancyOptimizer: each rank updates a shard, then broadcasts
    fused: bool = False  # the user's optimizer class with fused=True (one kernel per step, same math)
    cpu_allocator: bool = False  # ddpkit's CPU allocator (ddpkit.parallel.cpu_allocator); False: glibc's
    shard: bool = False  # ddpkit.step.sharding: each rank steps its share of the parameters, then publishes
    compile: bool = False  # s.model(..., compile=True): Inductor; compilation happens in the warm-up steps

    @property
    def group_key(self) -> tuple[int, int, bool]:
        """Configurations that can share one group of processes (the allocator is set per process)."""
        return (self.nproc, self.threads, self.cpu_allocator)

    def describe(self) -> str:
        parts = [f"{self.nproc} proc x {self.threads} thr"]
        if self.nproc > 1:
            parts.append(f"bucket {self.bucket_cap_mb or 25:g} MB")
            parts.append("bucket view" if self.gradient_as_bucket_view else "grad copies")
            if self.static_graph:
                parts.append("static graph")
            if self.hook != "allreduce":
                parts.append(f"hook {self.hook}" + (" (lossy)" if self.hook in LOSSY_HOOKS else ""))
            if self.zero:
                parts.append("ZeRO optimizer")
            if self.shard:
                parts.append("sharded step")
        if self.compile:
            parts.append("torch.compile")
        if self.fused:
            parts.append("optimizer fused=True")
        parts.append("memory kept (ddpkit)" if self.cpu_allocator else "glibc malloc")
        return ", ".join(parts)


def _build(workload: Any, cfg: Config, s: Session) -> tuple[torch.nn.Module, Any]:
    torch.manual_seed(0)
    model = s.model(
        workload.build(),
        bucket_cap_mb=cfg.bucket_cap_mb,
        gradient_as_bucket_view=cfg.gradient_as_bucket_view,
        static_graph=cfg.static_graph,
        comm_hook=None if cfg.hook == "allreduce" or s.world_size == 1 else cfg.hook,
        comm_hook_options=cfg.hook_options or None,
        compile=cfg.compile,
    )
    opt = workload.optimizer(model.parameters())
    if cfg.fused:
        opt = fused(opt)
    defaults = constructor_defaults(opt)
    if cfg.zero and s.world_size > 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=type(opt), **defaults)
    if cfg.shard and s.world_size > 1:
        return model, _Sharded(s, opt)  # s.backward + s.step: the sharded step where "auto" takes it
    return model, opt


class _Sharded:
    """An optimizer stepped as a user's loop steps it, through `s.backward` and `s.step` (the session's
    default shard_optimizer="auto" decides whether the step is sharded)."""

    def __init__(self, s: Session, opt: torch.optim.Optimizer) -> None:
        self.s, self.opt = s, opt

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none=set_to_none)

    def backward(self, loss: torch.Tensor) -> None:
        self.s.backward(loss)

    def step(self) -> None:
        self.s.step(self.opt)


def fused(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The same optimizer class and hyper-parameters with `fused=True`: one kernel per parameter tensor
    instead of one per elementwise operation (the for-loop CPU default), which on a memory-bound update
    reads and writes the optimizer state once instead of many times."""
    import inspect

    cls = type(opt)
    accepted = inspect.signature(cls).parameters
    if "fused" not in accepted:
        raise ValueError(f"{cls.__name__} has no fused implementation")
    keep = {k for k in accepted if k not in ("params", "fused", "foreach")}
    groups = [{k: v for k, v in g.items() if k in keep or k == "params"} for g in opt.param_groups]
    kwargs = {k: v for k, v in constructor_defaults(opt).items() if k in keep}
    return cls(groups, **kwargs, fused=True)  # type: ignore[call-arg]  # "fused" is accepted: checked above


def constructor_defaults(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """`opt.defaults` limited to what its class's constructor accepts (AdamW keeps extra keys there)."""
    import inspect

    accepted = inspect.signature(type(opt)).parameters
    return {k: v for k, v in opt.defaults.items() if k in accepted and k != "params"}


def _step(workload: Any, model: torch.nn.Module, opt: torch.optim.Optimizer, batch: Any) -> None:
    loss = workload.step_loss(model, batch)
    opt.zero_grad(set_to_none=False)
    if isinstance(opt, _Sharded):
        opt.backward(loss)
    else:
        loss.backward()
    opt.step()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _calibrate(s: Session, seconds: float, min_steps: int, target_s: float) -> int:
    """Steps for a block of about `target_s` seconds (at least `min_steps`), agreed by all ranks."""
    wanted = max(min_steps, min(500, int(target_s / max(seconds, 1e-6)) + 1))
    return int(s.all_reduce(wanted, op="max").item())


def run_group(
    spec: str, configs: Sequence[dict], steps: int, warmup: int, no_sync: bool, target_s: float = 1.0
) -> list[dict]:
    """Rank body: time each config once (one block of >= `target_s` seconds); return rank 0's measurements."""
    import ddpkit
    from ddpkit.tools import workloads

    workload = workloads.load(spec)
    out = []
    with ddpkit.session(seed=0, verbose=False) as s:
        per_rank = plan_batch(workload.global_batch, None, world_size=s.world_size).per_rank  # the loader's
        x, y = workload.sample(torch.Generator().manual_seed(1 + s.rank), per_rank)
        batch = (x.to(s.device), y.to(s.device))
        for raw in configs:
            cfg = Config(**raw)
            model, opt = _build(workload, cfg, s)
            for _ in range(warmup):
                start = time.perf_counter()
                _step(workload, model, opt, batch)
            n_steps = _calibrate(s, time.perf_counter() - start, steps, target_s)
            s.barrier()
            _sync(s.device)
            start = time.perf_counter()
            for _ in range(n_steps):
                _step(workload, model, opt, batch)
            _sync(s.device)
            result = {"label": cfg.label, "step_s": (time.perf_counter() - start) / n_steps, "steps": n_steps}
            result["threads_seen"] = torch.get_num_threads()
            result["world_size"] = s.world_size
            if no_sync and s.world_size > 1:  # the same steps without any all-reduce
                s.barrier()
                start = time.perf_counter()
                alone = opt.opt if isinstance(opt, _Sharded) else opt  # no publishing either: independent
                with model.no_sync():  # type: ignore[operator]
                    for _ in range(n_steps):
                        _step(workload, model, alone, batch)
                _sync(s.device)
                result["no_sync_step_s"] = (time.perf_counter() - start) / n_steps
            out.append(result)
            del model, opt
            gc.collect()
    return out


@dataclass
class Stats:
    """Per-config samples (one per round) in seconds, with the summary the tables print."""

    label: str
    samples: list[float] = field(default_factory=list)
    no_sync: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def spread(self) -> float:
        """(max - min) / median over rounds: how far to trust a difference between two medians."""
        return (max(self.samples) - min(self.samples)) / self.median if self.samples else 0.0

    @property
    def comm_share(self) -> float | None:
        """Share of the step added by communication: 1 - (step without all-reduce) / (step)."""
        if not self.no_sync:
            return None
        return max(0.0, 1.0 - statistics.median(self.no_sync) / self.median)

    def as_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "median_s": self.median,
            "min_s": min(self.samples),
            "max_s": max(self.samples),
            "spread": self.spread,
            "samples_s": self.samples,
            "comm_share": self.comm_share,
        }


def measure(
    spec: str,
    configs: Sequence[Config],
    *,
    rounds: int = 3,
    steps: int = 5,
    warmup: int = 2,
    target_s: float = 1.0,
    no_sync: bool = False,
    timeout: float = 900.0,
    log: Any = None,
) -> dict[str, Stats]:
    """Time every config `rounds` times, rotating through groups and configs; return stats by label."""
    import ddpkit

    groups: dict[tuple[int, int, bool], list[Config]] = {}
    for cfg in configs:
        groups.setdefault(cfg.group_key, []).append(cfg)
    stats = {cfg.label: Stats(cfg.label) for cfg in configs}
    for r in range(rounds):
        keys = list(groups)
        keys = keys[r % len(keys) :] + keys[: r % len(keys)]  # rotate which group goes first
        for key in keys:
            members = groups[key]
            members = members[r % len(members) :] + members[: r % len(members)]
            nproc, threads, allocator = key
            results = ddpkit.spawn(
                run_group,
                nproc=nproc,
                args=(spec, [asdict(c) for c in members], steps, max(1, warmup), no_sync, target_s),
                threads=threads,
                timeout=timeout,
                env={} if allocator else {CPU_ALLOCATOR_OPT_OUT: "default"},
            )[0]
            for res in results:
                if res["world_size"] != nproc or res["threads_seen"] != threads:
                    raise RuntimeError(
                        f"{res['label']}: ran with world {res['world_size']}, "
                        f"{res['threads_seen']} threads; expected {nproc} x {threads}"
                    )
                st = stats[res["label"]]
                st.samples.append(res["step_s"])
                if "no_sync_step_s" in res:
                    st.no_sync.append(res["no_sync_step_s"])
                if log:
                    log(f"  round {r + 1}/{rounds} {res['label']}: {res['step_s'] * 1e3:.1f} ms/step")
    return stats


def load_average() -> tuple[float, float, float]:
    try:
        return os.getloadavg()
    except OSError:
        return (0.0, 0.0, 0.0)


def variant(cfg: Config, **changes: Any) -> Config:
    return replace(cfg, **changes)
