"""What the always-on step anatomy costs (issue 33): the small CNN's DDP step with and without it.

    flock /tmp/ddpkit-cpu.lock .venv/bin/python scripts/bench_anatomy.py             # cnn, 2 ranks x 1 thread
    flock /tmp/ddpkit-cpu.lock .venv/bin/python scripts/bench_anatomy.py --rounds 15 --json runs/anatomy.json

Two measurements:
1. A/B in the same two gloo processes: the same loop over the same loader (s.backward, s.step) without the
   anatomy ("off": the session's `s.anatomy` swapped for a do-nothing object, its gradient hooks removed)
   and with exactly what `fit` runs ("on": the session's marks in s.backward / s.step, fit's own marks,
   the gradient hooks that time the last gradient, and every 10 steps the 9-number all_gather and the
   slow-rank check).
   Interleaved blocks of one epoch each (off on on off ...: neither always goes first), the per-round
   ratio on/off summarised as median and [min, max]. On a shared machine this ratio's spread is larger
   than the effect, so:
2. the direct cost: the anatomy's own per-step calls timed alone (marks + end_step; the hook per
   parameter per backward), and the gather's time, per step (divided by 10). This is the figure to
   compare with 1% of the step.
Load average before and after is printed (the machine is shared: numbers under load are provisional).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import ddpkit
from ddpkit.observe.anatomy import StepAnatomy
from ddpkit.observe.monitor import StepMonitor
from ddpkit.tools import workloads


def _epoch(s, wl, model, opt, loader, monitor: StepMonitor | None) -> int:
    steps = 0
    mark = monitor.anatomy.mark if monitor is not None else None
    for batch in loader:
        if mark:
            mark("data")
        loss = wl.step_loss(model, batch)
        if mark:
            mark("forward")
        s.backward(loss)
        if mark:
            mark("backward")
            mark("other")
        s.step(opt)
        steps += 1
        if monitor is not None:
            mark("optimizer")  # type: ignore[misc]
            monitor.anatomy.end_step()
            monitor.after_step(steps)
            mark("other")  # type: ignore[misc]
    return steps


class _Off:
    """A do-nothing anatomy for the "off" arm (the session calls mark / stepped / watch)."""

    def mark(self, phase: str) -> None: ...
    def stepped(self, applied: bool) -> None: ...
    def watch(self, model: torch.nn.Module) -> None: ...


def _direct_costs(model: torch.nn.Module, n: int = 20000) -> dict[str, float]:
    """Seconds per step of the anatomy's own calls (no training), and per hook call."""
    anatomy = StepAnatomy()
    t0 = time.perf_counter()
    for _ in range(n):  # what fit and the session call per step (fit's marks, then the session's)
        anatomy.mark("data")
        anatomy.mark("forward")
        anatomy.mark("forward")
        anatomy._grad_ready(None)  # type: ignore[arg-type]
        anatomy.mark("backward")
        anatomy.mark("backward")
        anatomy.mark("other")
        anatomy.stepped(True)
        anatomy.mark("optimizer")
        anatomy.end_step()
        anatomy.mark("other")
    calls = (time.perf_counter() - t0) / n
    # one post-accumulate-grad hook as autograd calls it: a tiny backward with and without it, interleaved
    leaf = torch.zeros(1, requires_grad=True)
    pairs = []
    for _ in range(7):
        arms = {}
        for with_hook in (False, True):
            handle = leaf.register_post_accumulate_grad_hook(anatomy._grad_ready) if with_hook else None
            t0 = time.perf_counter()
            for _ in range(n // 10):
                leaf.sum().backward()
            arms[with_hook] = (time.perf_counter() - t0) / (n // 10)
            if handle is not None:
                handle.remove()
        pairs.append(arms[True] - arms[False])
    hook = max(0.0, statistics.median(pairs))
    params = sum(1 for p in model.parameters() if p.requires_grad)
    return {"calls_s": calls, "hook_s": hook, "params": params}


def rank_main(rounds: int, batches: int) -> dict:
    wl = workloads.load("cnn")
    data = wl.dataset(batches=batches)
    with ddpkit.session(seed=0, verbose=False, log_to=None) as s:
        torch.manual_seed(0)
        model = s.model(wl.build())
        opt = wl.optimizer(model.parameters())
        loader = s.loader(data, batch_size=wl.global_batch, shuffle=True)
        real = s.anatomy
        monitor = StepMonitor(s, flops=None, every=10, main=s.is_main, report=lambda _: None, anatomy=real)
        _epoch(s, wl, model, opt, loader, None)  # warm-up
        times: dict[str, list[float]] = {"off": [], "on": []}
        for r in range(rounds):
            for arm in ("off", "on") if r % 2 == 0 else ("on", "off"):
                if arm == "on":
                    s.anatomy = real
                    real.watch(model)
                else:
                    real.unwatch()
                    s.anatomy = _Off()  # type: ignore[assignment]
                dist.barrier()
                t0 = time.perf_counter()
                steps = _epoch(s, wl, model, opt, loader, monitor if arm == "on" else None)
                times[arm].append((time.perf_counter() - t0) / steps)
        gathers = []
        for _ in range(50):  # the gather alone: one all_gather of 9 numbers and the check
            dist.barrier()
            t0 = time.perf_counter()
            monitor.view.after_step(monitor.anatomy.steps)  # a multiple of 10: it gathers
            gathers.append(time.perf_counter() - t0)
            monitor.anatomy.steps = 10 * (monitor.anatomy.steps // 10 + 1)
        return {"times": times, "direct": _direct_costs(model), "gather_s": statistics.median(gathers)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--batches", type=int, default=40, help="global batches per epoch (one block)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--json", default=None)
    ns = p.parse_args(argv)
    before = os.getloadavg()
    out = ddpkit.spawn(rank_main, nproc=ns.nproc, args=(ns.rounds, ns.batches), threads=1, timeout=900)
    after = os.getloadavg()
    t = out[0]["times"]
    ratios = [on / off for on, off in zip(t["on"], t["off"], strict=True)]
    off_ms = statistics.median(t["off"]) * 1e3
    d = out[0]["direct"]
    per_step = d["calls_s"] + d["hook_s"] * d["params"] + out[0]["gather_s"] / 10
    print(
        f"anatomy overhead, cnn, {ns.nproc} ranks x 1 thread, gloo; "
        f"load average {before[0]:.2f} -> {after[0]:.2f}"
    )
    print(
        f"A/B: step {off_ms:.2f} ms off, {statistics.median(t['on']) * 1e3:.2f} ms on; ratio on/off "
        f"{statistics.median(ratios):.4f} [{min(ratios):.4f}, {max(ratios):.4f}] over {ns.rounds} rounds"
    )
    print(
        f"direct: marks + end_step {d['calls_s'] * 1e6:.1f} us, hook {d['hook_s'] * 1e6:.2f} us x "
        f"{d['params']} parameters, gather {out[0]['gather_s'] * 1e6:.0f} us / 10 steps = "
        f"{per_step * 1e6:.1f} us per step = {per_step / (off_ms / 1e3):.3%} of the step"
    )
    if ns.json:
        os.makedirs(os.path.dirname(ns.json) or ".", exist_ok=True)
        with open(ns.json, "w") as f:
            json.dump({"load": [before, after], "ranks": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
