"""`ddpkit trace`: a per-rank timeline of a few training steps, and what DDP's buckets do in them.

    ddpkit trace --workload mlp                     # 2 CPU ranks, 3 traced steps after 2 warm-up steps
    ddpkit trace --workload gpt --strategy fsdp     # FSDP2: each block's all-gather and reduce-scatter
    ddpkit trace --workload gpt --hook shm --explain --out runs/trace-gpt
    ddpkit trace --ranks --workload cnn --steps 200  # every rank's phases side by side over many steps

Recorded on every rank: forward, backward and optimizer step, and each gradient bucket's all-reduce from
launch (DDP calls the communication hook when the bucket's last gradient is ready) to completion (the
hook's future resolves). A wrapping hook timestamps both around the real one ("allreduce" = DDP's
default, or any ddpkit hook name). Written as a Chrome trace (`trace.json`: open it in
https://ui.perfetto.dev or chrome://tracing) and a PNG.

Overlap: within a step, gradient computation ends when the last bucket is launched; the rest of
backward is waiting for communication. The share of all-reduce time that falls before that point was
hidden behind computation; the rest was exposed (it lengthened the step). Clocks: CLOCK_MONOTONIC,
shared by the processes of one machine. `--explain` lists the buckets: which parameters, bytes, and the
order they fire in (reverse registration order after DDP rebuilds buckets on the first step).
`--ranks` draws many steps instead, one panel per rank (`ddpkit.tools.trace_ranks`).
"""

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ddpkit import strategy as strategies
from ddpkit.data import plan_batch
from ddpkit.errors import problem

if TYPE_CHECKING:
    from ddpkit import Session

_now = time.perf_counter  # CLOCK_MONOTONIC on Linux: comparable across processes of one machine


class Recorder:
    """Events of one rank: (name, track, start, end, extra)."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.buckets: dict[int, dict[str, Any]] = {}
        self.step = -1
        self.enabled = False

    def add(self, name: str, track: str, start: float, end: float, **extra: Any) -> None:
        if self.enabled:
            self.events.append(
                {"name": name, "track": track, "start": start, "end": end, "step": self.step, **extra}
            )


class TracedHook:
    """State of the wrapping hook: the real hook's state and function, the recorder, parameter names."""

    def __init__(self, inner_state: Any, inner_hook: Any, recorder: Recorder, names: dict[int, str]) -> None:
        self.inner_state, self.inner_hook = inner_state, inner_hook
        self.recorder, self.names = recorder, names


def traced_hook(state: TracedHook, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Time the real hook from launch to the completion of its future."""
    rec = state.recorder
    index = bucket.index()
    buffer = bucket.buffer()
    if index not in rec.buckets or rec.enabled:
        rec.buckets[index] = {
            "bytes": buffer.numel() * buffer.element_size(),
            "params": [state.names.get(id(p), "?") for p in bucket.parameters()],
        }
    start = _now()
    fut = state.inner_hook(state.inner_state, bucket)
    step = rec.step

    def done(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        if step == rec.step:
            rec.add(
                f"all-reduce bucket {index}",
                f"bucket {index}",
                start,
                _now(),
                bucket=index,
                bytes=buffer.numel() * buffer.element_size(),
            )
        return f.value()

    return fut.then(done)


def _rank(
    spec: str, hook: str, bucket_cap_mb: float | None, warmup: int, steps: int, strategy: str = "ddp"
) -> dict[str, Any]:
    import ddpkit
    from ddpkit.parallel import comm_hooks
    from ddpkit.tools import workloads

    wl = workloads.load(spec)
    rec = Recorder()
    with ddpkit.session(seed=0, verbose=False, strategy=strategy) as s:
        torch.manual_seed(0)
        module = wl.build()
        names = {id(p): n for n, p in module.named_parameters()}
        if s.strategy.shards_state:  # FSDP, HSDP, a registered sharded strategy: traced by its blocks
            model = s.model(module)
            return _fsdp_steps(s, wl, model, rec, warmup, steps)
        model = s.model(module, bucket_cap_mb=bucket_cap_mb)
        ran = ""  # the hook's function, as DDP runs it (ranks.json: which hook was traced)
        if s.world_size > 1:
            if hook == "allreduce":
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

                inner: tuple[Any, Any] = (None, default_hooks.allreduce_hook)
            else:
                inner = comm_hooks.resolve(hook)(None)
            model.register_comm_hook(TracedHook(*inner, rec, names), traced_hook)  # type: ignore[operator]
            ran = getattr(inner[1], "__name__", type(inner[1]).__name__)
        opt = wl.optimizer(model.parameters())
        per_rank = plan_batch(wl.global_batch, None, world_size=s.world_size).per_rank  # the loader's split
        x, y = wl.sample(torch.Generator().manual_seed(1 + s.rank), per_rank)
        x, y = x.to(s.device), y.to(s.device)
        sync = torch.cuda.synchronize if s.device.type == "cuda" else lambda: None  # times mean GPU work
        for i in range(warmup + steps):
            rec.enabled = i >= warmup
            rec.step = i - warmup
            s.barrier()
            t0 = _now()
            out = model(x)
            loss = wl.loss(out.reshape(-1, out.shape[-1]), y.reshape(-1))
            sync()
            t1 = _now()
            s.backward(loss)
            sync()
            t2 = _now()
            s.step(opt)  # ddpkit's step: on CPU ranks of one machine, sharded (ddpkit.step.sharding)
            sync()
            t3 = _now()
            rec.add("forward", "compute", t0, t1)
            rec.add("backward", "compute", t1, t2)
            rec.add("optimizer step", "compute", t2, t3)
        return {
            "rank": s.rank,
            "world": s.world_size,
            "events": rec.events,
            "buckets": rec.buckets,
            "hook": ran,
        }


_FSDP_KINDS = {"all_gather": "all-gather", "post_backward_reduce": "reduce-scatter"}
_FSDP_LABEL = re.compile(r"^FSDP::(all_gather|post_backward_reduce)(?: \((.*?)\))?(?: \[pg=\d+\])?$")


def _fsdp_steps(s: "Session", wl: Any, model: Any, rec: Recorder, warmup: int, steps: int) -> dict[str, Any]:
    """FSDP: the phases by the clock, and each block's all-gather and reduce-scatter from the labels FSDP2
    gives them in torch's profiler, moved onto the same clock through the first traced forward."""
    from torch.profiler import ProfilerActivity, profile, record_function

    opt = wl.optimizer(model.parameters())
    per_rank = plan_batch(wl.global_batch, None, world_size=s.world_size).per_rank
    x, y = wl.sample(torch.Generator().manual_seed(1 + s.rank), per_rank)
    first_forward = 0.0
    prof = profile(activities=[ProfilerActivity.CPU])
    for i in range(warmup + steps):
        rec.enabled = i >= warmup
        rec.step = i - warmup
        if i == warmup:
            prof.__enter__()
        s.barrier()
        t0 = _now()
        with record_function("ddpkit::forward"):
            out = model(x)
        loss = wl.loss(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        t1 = _now()
        s.backward(loss)
        t2 = _now()
        s.step(opt)
        t3 = _now()
        first_forward = t0 if i == warmup else first_forward
        rec.add("forward", "compute", t0, t1)
        rec.add("backward", "compute", t1, t2)
        rec.add("optimizer step", "compute", t2, t3)
    prof.__exit__(None, None, None)
    events = prof.events()
    anchor = min(e.time_range.start for e in events if e.name == "ddpkit::forward")
    offset = first_forward - anchor / 1e6
    units: dict[str, int] = {}
    step_starts = sorted(e["start"] for e in rec.events if e["name"] == "forward")
    for e in sorted(events, key=lambda e: e.time_range.start):
        label = _FSDP_LABEL.match(e.name)
        if label is None:
            continue
        kind, fqn = _FSDP_KINDS[label.group(1)], label.group(2) or "root"
        index = units.setdefault(fqn, len(units))
        start, end = e.time_range.start / 1e6 + offset, e.time_range.end / 1e6 + offset
        rec.step = max(0, sum(1 for t in step_starts if t <= start) - 1)
        rec.add(f"{kind} {fqn}", kind, start, end, bucket=index)
    buckets = {i: {"bytes": 0, "params": [fqn]} for fqn, i in units.items()}
    return {"rank": s.rank, "world": s.world_size, "events": rec.events, "buckets": buckets}


def overlap(events: list[dict[str, Any]]) -> dict[str, float]:
    """Hidden and exposed all-reduce seconds of one rank's events (see the module docstring)."""
    hidden = exposed = 0.0
    for step in sorted({e["step"] for e in events}):
        comm = sorted((e["start"], e["end"]) for e in events if e["step"] == step and e["track"] != "compute")
        if not comm:
            continue
        compute_end = max(start for start, _ in comm)  # the last bucket's gradients were ready here
        for start, end in _union(comm):
            hidden += max(0.0, min(end, compute_end) - start)
            exposed += max(0.0, end - max(start, compute_end))
    total = hidden + exposed
    return {"hidden_s": hidden, "exposed_s": exposed, "hidden_share": hidden / total if total else 0.0}


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


def chrome_trace(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Chrome trace format: complete ("X") events in microseconds, one process per rank."""
    origin = min(e["start"] for r in ranks for e in r["events"])
    events: list[dict[str, Any]] = []
    for r in ranks:
        pid = r["rank"]
        events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"rank {pid}"}})
        tracks = sorted({e["track"] for e in r["events"]}, key=lambda t: (t != "compute", t))
        for tid, track in enumerate(tracks):
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": track}})
        for e in r["events"]:
            args = {k: v for k, v in e.items() if k not in ("name", "track", "start", "end")}
            events.append(
                {
                    "name": e["name"],
                    "ph": "X",
                    "pid": pid,
                    "tid": tracks.index(e["track"]),
                    "ts": (e["start"] - origin) * 1e6,
                    "dur": (e["end"] - e["start"]) * 1e6,
                    "args": args,
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


_BUCKET_COLORS = ("#7b68ee", "#8b4513", "#708090", "#c71585", "#20b2aa", "#b8860b")


def plot(ranks: list[dict[str, Any]], path: str, title: str) -> str:
    from ddpkit.tools.plotting import pyplot

    plt = pyplot()
    colors = {"forward": "#3366cc", "backward": "#ff9933", "optimizer step": "#33aa55"}
    origin = min(e["start"] for r in ranks for e in r["events"])
    fig, ax = plt.subplots(figsize=(11, 1.6 + 1.1 * len(ranks)), dpi=110)
    labels = []
    for r in ranks:
        y = 2 * (len(ranks) - 1 - r["rank"])
        n_buckets = max(1, len(r["buckets"]))
        for e in r["events"]:
            if e["track"] == "compute":
                color, bottom, height = colors[e["name"]], y + 1.1, 0.8
            else:  # one lane per bucket: in-flight all-reduces overlap in time
                b = e.get("bucket", 0)
                color, height = _BUCKET_COLORS[b % len(_BUCKET_COLORS)], 0.8 / n_buckets
                bottom = y + 0.1 + (n_buckets - 1 - b % n_buckets) * height
            ax.broken_barh(
                [((e["start"] - origin) * 1e3, (e["end"] - e["start"]) * 1e3)],
                (bottom, height),
                facecolors=color,
                edgecolors="white",
                linewidth=0.3,
            )
        labels += [(y + 0.5, f"rank {r['rank']} all-reduce"), (y + 1.5, f"rank {r['rank']} compute")]
    ax.set_yticks([p for p, _ in labels], [t for _, t in labels], fontsize=8)
    ax.set(xlabel="ms", title=title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in (*colors.values(), _BUCKET_COLORS[0])]
    names = [*colors, "all-reduce, launch to completion (a colour per bucket)"]
    ax.legend(
        handles, names, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=4, frameon=False
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def explain(rank0: dict[str, Any]) -> list[str]:
    order = [e["bucket"] for e in rank0["events"] if e["track"] != "compute" and e["step"] == 0]
    launch = sorted((e["start"], e["bucket"]) for e in rank0["events"] if e["step"] == 0 and "bucket" in e)
    firing = [b for _, b in launch] or order
    lines = [f"{len(rank0['buckets'])} bucket(s); firing order in a step: {firing}"]
    for index in sorted(rank0["buckets"], key=lambda i: firing.index(i) if i in firing else i):
        b = rank0["buckets"][index]
        params = b["params"]
        shown = ", ".join(params[:6]) + (f", ... (+{len(params) - 6})" if len(params) > 6 else "")
        lines.append(f"  bucket {index}: {b['bytes'] / 2**20:.2f} MiB, {len(params)} parameter(s): {shown}")
    return lines


def _check_hook(hook: str, strategy: str = "ddp") -> None:
    """Refuse an unknown --hook once, here, before any rank starts: in the ranks each would fail alone; and a
    hook under a strategy that has none (FSDP's collectives are not DDP's buckets: it would be ignored)."""
    from ddpkit.parallel import comm_hooks

    known = ["allreduce", *sorted(comm_hooks.HOOKS)]
    if hook not in known:
        raise problem(
            f"--hook {hook!r} is not a known communication hook",
            f"Use one of {', '.join(known)} (allreduce: DDP's default)",
        )
    if hook != "allreduce" and strategy != "ddp":
        raise problem(
            f"--hook {hook} traces DDP's buckets, but --strategy {strategy} has no communication hook (its "
            "all-gathers and reduce-scatters are traced as they are)",
            f"Drop --hook to trace {strategy}, or use --strategy ddp to trace the {hook} hook",
        )


def main(argv: Sequence[str] | None = None) -> int:
    import ddpkit

    p = argparse.ArgumentParser(prog="ddpkit trace", description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="mlp", help="cnn, mlp, gpt, or package.module:function")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--hook", default="allreduce", help="allreduce (DDP's default), shm, fp16, bf16, powersgd")
    p.add_argument("--bucket-cap-mb", type=float, default=None)
    p.add_argument(
        "--strategy",
        choices=strategies.distributed(),
        default="ddp",
        help="fsdp: each block's all-gather and reduce-scatter, not buckets",
    )
    p.add_argument("--warmup", type=int, default=2, help="untraced steps first (DDP rebuilds buckets)")
    p.add_argument("--steps", type=int, default=None, help="traced steps (default 3; with --ranks 200)")
    p.add_argument("--ranks", action="store_true", help="every rank's step anatomy over many steps (PNG)")
    p.add_argument("--slow", default=None, help="with --ranks: plant RANK:MS:data|forward, e.g. 1:30:data")
    p.add_argument("--explain", action="store_true", help="list the buckets: parameters, bytes, order")
    p.add_argument("--out", default="runs/trace")
    ns = p.parse_args(argv)
    if ns.nproc < 2:
        print("ddpkit trace: --nproc must be 2 or more: with one process there is no all-reduce to trace")
        return 2
    _check_hook(ns.hook, ns.strategy)
    if ns.ranks:
        from ddpkit.tools import trace_ranks

        return trace_ranks.main_ranks(ns.workload, ns.nproc, ns.steps or 200, ns.slow, ns.out)
    ns.steps = ns.steps or 3
    args = (ns.workload, ns.hook, ns.bucket_cap_mb, max(1, ns.warmup), ns.steps, ns.strategy)
    ranks = ddpkit.spawn(_rank, nproc=ns.nproc, args=args, threads=1, timeout=600)
    for r in ranks:  # JSON keys: bucket indices arrive as ints from the ranks
        r["buckets"] = {int(k): v for k, v in r["buckets"].items()}
    os.makedirs(ns.out, exist_ok=True)
    trace_path = os.path.join(ns.out, "trace.json")
    with open(trace_path, "w") as f:
        json.dump(chrome_trace(ranks), f)
    title = f"{ns.workload}: {ns.nproc} ranks, hook {ns.hook}, {ns.steps} steps"
    png = plot(ranks, os.path.join(ns.out, "trace.png"), title)
    for r in ranks:
        ov = overlap(r["events"])
        comp = {
            n: sum(e["end"] - e["start"] for e in r["events"] if e["name"] == n) / ns.steps * 1e3
            for n in ("forward", "backward", "optimizer step")
        }
        hidden, exposed = ov["hidden_s"] / ns.steps * 1e3, ov["exposed_s"] / ns.steps * 1e3
        print(
            f"rank {r['rank']}: forward {comp['forward']:.1f} ms, backward {comp['backward']:.1f} ms, "
            f"optimizer {comp['optimizer step']:.1f} ms per step; all-reduce {hidden:.1f} ms hidden + "
            f"{exposed:.1f} ms exposed = {ov['hidden_share']:.0%} hidden behind backward"
        )
    if ns.explain:
        print("\n".join(explain(ranks[0])))
    print(f"chrome trace: {trace_path} (open in https://ui.perfetto.dev)\nplot: {png}")
    with open(os.path.join(ns.out, "ranks.json"), "w") as f:
        json.dump(ranks, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
