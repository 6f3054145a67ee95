"""Profile one training step on one device: what the simulator needs to replay it on N devices.

Measured in a fresh process (`ddpkit.spawn(nproc=1)`, so memory settings and threads are those of a
real rank): forward, backward and optimizer-step times, and for every parameter the moment, counted
from the start of backward, at which its gradient has been accumulated (an autograd
post-accumulate-grad hook; CUDA events on a GPU). DDP launches a bucket's all-reduce when the last of
its gradients is ready, so a bucket's ready time is the latest of its parameters'.

Buckets are those DDP uses after its first iteration: it rebuilds them in the order gradients became
ready, the first capped at 1 MiB (`dist._DEFAULT_FIRST_BUCKET_BYTES`), the others at `bucket_cap_mb`,
a bucket closing as soon as it reaches its cap (`assign_buckets`, the rule of torch's
`compute_bucket_assignment_by_size`, pinned against it in tests/test_plan.py).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

FIRST_BUCKET_BYTES = 1 << 20  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES


@dataclass(frozen=True, kw_only=True)
class Param:
    """One trainable parameter: its shape, gradient bytes and when its gradient is ready in backward."""

    name: str
    shape: tuple[int, ...]
    bytes: int
    ready_s: float


@dataclass(frozen=True, kw_only=True)
class Bucket:
    """A DDP gradient bucket: parameters (indices into `Profile.params`), bytes, ready time."""

    params: tuple[int, ...]
    bytes: int
    ready_s: float


@dataclass(frozen=True, kw_only=True)
class Profile:
    """One device's training step at a per-device batch of `batch` samples (times in seconds, medians)."""

    workload: str
    device: str
    threads: int
    batch: int
    forward_s: float
    backward_s: float
    optimizer_s: float
    copy_s: float  # one copy of all parameters (what publishing a sharded step's result costs)
    params: tuple[Param, ...]  # in the order their gradients became ready
    state_bytes: int  # optimizer state
    spread: float = 0.0  # (max - min) / median of the step time over the timed steps
    ranks: int = 1  # profiled while this many ranks computed at once on the machine (no communication)
    straggler_s: float = 0.0  # with ranks > 1: how long the slowest rank's step outlasts the average
    step_s: tuple[float, ...] = ()  # each timed step's forward + backward + optimizer
    # Over repeated profiles (fresh processes): the lowest and highest compute time relative to the
    # median one, which this profile is (two runs gave 697 and 822 ms for one device).
    band: tuple[float, float] = (1.0, 1.0)

    @property
    def param_bytes(self) -> int:
        return sum(p.bytes for p in self.params)

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s + self.optimizer_s

    def buckets(self, cap_mb: float = 25.0, first_bytes: int = FIRST_BUCKET_BYTES) -> list[Bucket]:
        groups = assign_buckets([p.bytes for p in self.params], int(cap_mb * 1024 * 1024), first_bytes)
        return [
            Bucket(
                params=tuple(g),
                bytes=sum(self.params[i].bytes for i in g),
                ready_s=max(self.params[i].ready_s for i in g),
            )
            for g in groups
        ]

    def scaled(self, compute: float, optimizer: float | None = None) -> Profile:
        """Forward and backward (and ready times) times `compute`; the optimizer step times `optimizer`
        (default: `compute`). Used for another per-device batch or a faster device."""
        opt = compute if optimizer is None else optimizer
        return replace(
            self,
            forward_s=self.forward_s * compute,
            backward_s=self.backward_s * compute,
            optimizer_s=self.optimizer_s * opt,
            copy_s=self.copy_s * opt,
            params=tuple(replace(p, ready_s=p.ready_s * compute) for p in self.params),
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        params = tuple(Param(**{**p, "shape": tuple(p["shape"])}) for p in data["params"])
        band = tuple(data.get("band", (1.0, 1.0)))
        return cls(**{**data, "params": params, "step_s": tuple(data.get("step_s", ())), "band": band})

    def at_band(self, end: int) -> Profile:
        """This profile with compute at the low (`end`=0) or high (1) end of its band."""
        return self.scaled(self.band[end])


def median_of(repeats: Sequence[Profile]) -> Profile:
    """The repeat whose compute time is the median (an actual run: its parameters' ready times stay
    consistent), with `band` = the lowest and highest repeat's compute time relative to it."""
    ordered = sorted(repeats, key=lambda q: q.compute_s)
    mid = ordered[(len(ordered) - 1) // 2]
    return replace(mid, band=(ordered[0].compute_s / mid.compute_s, ordered[-1].compute_s / mid.compute_s))


def assign_buckets(
    sizes: Sequence[int], cap_bytes: int, first_bytes: int = FIRST_BUCKET_BYTES
) -> list[list[int]]:
    """Indices of `sizes` (in gradient-ready order) grouped as DDP's reducer groups them: a bucket
    closes when it reaches its limit; the first bucket's limit is `first_bytes`, the others' `cap_bytes`."""
    buckets: list[list[int]] = []
    current: list[int] = []
    size, limit = 0, first_bytes
    for i, s in enumerate(sizes):
        current.append(i)
        size += s
        if size >= limit:
            buckets.append(current)
            current, size, limit = [], 0, cap_bytes
    if current:
        buckets.append(current)
    return buckets


def interpolate(profiles: dict[int, Profile], batch: int) -> Profile:
    """The profile at `batch`: measured if it was, else linear in the batch between the nearest two
    measured (compute grows linearly with samples; the optimizer step does not depend on the batch)."""
    if batch in profiles:
        return profiles[batch]
    known = sorted(profiles)
    lo = max([b for b in known if b < batch], default=known[0])
    hi = min([b for b in known if b > batch], default=known[-1])
    if lo == hi:  # outside the measured range: proportional to the batch from the nearest
        p = profiles[lo]
        return replace(p.scaled(batch / lo, optimizer=1.0), batch=batch)
    a, b = profiles[lo], profiles[hi]
    w = (batch - lo) / (hi - lo)

    def mix(x: float, y: float) -> float:
        return x + (y - x) * w

    params = tuple(
        replace(pa, ready_s=mix(pa.ready_s, pb.ready_s)) for pa, pb in zip(a.params, b.params, strict=True)
    )
    return replace(
        a,
        batch=batch,
        forward_s=mix(a.forward_s, b.forward_s),
        backward_s=mix(a.backward_s, b.backward_s),
        optimizer_s=mix(a.optimizer_s, b.optimizer_s),
        params=params,
    )


def measure(
    spec: str,
    batches: Sequence[int],
    *,
    ranks: int = 1,
    threads: int = 1,
    device: str = "cpu",
    steps: int = 6,
    warmup: int = 3,
    timeout: float = 600.0,
    repeats: int = 1,
) -> dict[int, Profile]:
    """Profile workload `spec` (a name or package.module:function) at each per-device batch.

    `repeats` > 1 profiles that many times, each in fresh processes, and returns the median repeat with
    the spread as its `band` (`median_of`): one process's profile moves by 10-20 % from run to run here.

    With `ranks` > 1, that many processes on this machine profile at once, each on its own (no
    communication, steps started together): what a rank computes while the others compute beside it
    on shared cores and memory. Rank 0's profile is returned, with `straggler_s`, the median over
    steps of (slowest rank's step - the ranks' mean step): what every all-reduce waits for."""
    import ddpkit

    runs: dict[int, list[Profile]] = {}
    for _ in range(max(1, repeats)):
        out = ddpkit.spawn(
            _rank,
            nproc=ranks,
            args=(spec, list(batches), steps, warmup, device),
            threads=threads,
            timeout=timeout,
        )
        for b in out[0]:
            each = [Profile.from_dict(r[b]) for r in out]
            p = _mean(each)
            if ranks > 1:
                per_step = list(zip(*(q.step_s for q in each), strict=True))
                wait = statistics.median(max(t) - sum(t) / len(t) for t in per_step)
                p = replace(p, ranks=ranks, straggler_s=wait)
            runs.setdefault(int(b), []).append(p)
    return {b: median_of(ps) for b, ps in runs.items()}


def _mean(profiles: list[Profile]) -> Profile:
    """The ranks' average profile (times of each parameter matched by name): the typical rank, to which
    the straggler wait is added (rank 0 alone can be lucky or unlucky with the shared cores)."""
    k = len(profiles)

    def avg(get: Any) -> float:
        return sum(get(q) for q in profiles) / k

    ready = {
        p.name: avg(lambda q, name=p.name: next(x.ready_s for x in q.params if x.name == name))
        for p in profiles[0].params
    }
    params = tuple(
        sorted((replace(p, ready_s=ready[p.name]) for p in profiles[0].params), key=lambda x: x.ready_s)
    )
    return replace(
        profiles[0],
        forward_s=avg(lambda q: q.forward_s),
        backward_s=avg(lambda q: q.backward_s),
        optimizer_s=avg(lambda q: q.optimizer_s),
        copy_s=avg(lambda q: q.copy_s),
        params=params,
    )


def _rank(spec: str, batches: list[int], steps: int, warmup: int, device: str) -> dict[int, dict[str, Any]]:
    import torch

    import ddpkit
    from ddpkit.tools import workloads

    wl = workloads.load(spec)
    out = {}
    with ddpkit.session(seed=0, verbose=False, device=device) as s:
        for batch in batches:
            torch.manual_seed(0)
            module = wl.build()
            # Alone: wrapped as a user's script would be (no DDP at world 1). Beside other ranks: the
            # bare module, so that the ranks compute side by side without communicating.
            model = s.model(module) if s.world_size == 1 else module.to(s.device)
            opt = wl.optimizer(model.parameters())
            x, y = wl.sample(torch.Generator().manual_seed(1 + s.rank), batch)
            sync = s.barrier if s.world_size > 1 else None
            prof = _profile(wl, model, opt, (x.to(s.device), y.to(s.device)), s.device, steps, warmup, sync)
            out[batch] = replace(
                prof, workload=wl.name, device=s.device.type, threads=torch.get_num_threads(), batch=batch
            ).as_dict()
            del model, opt, module
    return out


class _Clock:
    """Wall-clock marks on the CPU; CUDA events on a GPU (kernels run asynchronously there)."""

    def __init__(self, device: Any) -> None:
        import torch

        self.cuda = device.type == "cuda"
        self.torch = torch

    def mark(self) -> Any:
        if self.cuda:
            e = self.torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def seconds(self, a: Any, b: Any) -> float:
        if self.cuda:
            self.torch.cuda.synchronize()
            return a.elapsed_time(b) / 1e3
        return b - a


def _profile(
    wl: Any, model: Any, opt: Any, batch: Any, device: Any, steps: int, warmup: int, sync: Any = None
) -> Profile:
    import torch

    clock = _Clock(device)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    marks: dict[int, Any] = {}
    handles = [
        p.register_post_accumulate_grad_hook(lambda p, i=i: marks.__setitem__(i, clock.mark()))
        for i, (_, p) in enumerate(named)
    ]
    samples: list[dict[str, Any]] = []
    try:
        for step in range(warmup + steps):
            marks.clear()
            if sync is not None:
                sync()
            t0 = clock.mark()
            loss = wl.step_loss(model, batch)
            t1 = clock.mark()
            loss.backward()
            t2 = clock.mark()
            opt.step()
            t3 = clock.mark()
            opt.zero_grad(set_to_none=False)
            if step >= warmup:
                ready = {i: clock.seconds(t1, m) for i, m in marks.items()}
                samples.append(
                    {
                        "f": clock.seconds(t0, t1),
                        "b": clock.seconds(t1, t2),
                        "o": clock.seconds(t2, t3),
                        "ready": ready,
                    }
                )
    finally:
        for h in handles:
            h.remove()
    med = statistics.median
    backward = med(s["b"] for s in samples)
    params = []
    for i, (name, p) in enumerate(named):
        times = [s["ready"].get(i, s["b"]) for s in samples]  # no gradient: counted as ready at the end
        params.append(
            Param(
                name=name,
                shape=tuple(p.shape),
                bytes=p.numel() * p.element_size(),
                ready_s=min(med(times), backward),
            )
        )
    params.sort(key=lambda q: q.ready_s)
    totals = [s["f"] + s["b"] + s["o"] for s in samples]
    flat = torch.empty(sum(p.numel() for _, p in named), device=device)
    copy = []
    for _ in range(3):
        t0 = clock.mark()
        torch.cat([p.detach().reshape(-1) for _, p in named], out=flat)
        copy.append(clock.seconds(t0, clock.mark()))
    state = sum(
        t.numel() * t.element_size()
        for st in opt.state.values()
        for t in st.values()
        if isinstance(t, torch.Tensor)
    )
    return Profile(
        workload="",
        device="",
        threads=0,
        batch=0,
        forward_s=med(s["f"] for s in samples),
        backward_s=backward,
        optimizer_s=med(s["o"] for s in samples),
        copy_s=med(copy),
        params=tuple(params),
        state_bytes=state,
        step_s=tuple(totals),
        spread=(max(totals) - min(totals)) / med(totals),
    )
