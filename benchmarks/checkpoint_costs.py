"""What checkpoints cost training: the preemption agreement per step, and a save, sync vs background.

    ddpkit run --nproc 2 benchmarks/checkpoint_costs.py agree      # small CNN: s.save(every=) per step
    ddpkit run --nproc 2 benchmarks/checkpoint_costs.py save       # 37.8M MLP: one save per window
    ddpkit run --nproc 2 benchmarks/checkpoint_costs.py save fsdp  # the same under FSDP

agree: steps of the CIFAR tutorial CNN (global batch 64), in interleaved blocks with and without
`s.save(root, ..., step=step, every=10**9)` after each step (which never writes: only the agreement);
reports the median step of each kind and the median time inside that call.
save: (CHECKPOINT_COSTS_STRATEGY=fsdp for FSDP; DDPKIT_WRITER_NICE=0 for a writer at training's
priority) windows of W steps of the 37.8M-parameter MLP with AdamW (global batch 64); a window either has
no save, a synchronous save, or a background save at its first step; the training time a save
costs is the window's time minus the median window without a save. A background write still in
flight at the end of its window is waited for outside the timed window (and reported).
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import ddpkit
from ddpkit.tools.workloads import NAMED

ROOT = Path(tempfile.gettempdir()) / "ddpkit-checkpoint-costs"


def _setup(s, name: str):
    wl = NAMED[name]
    torch.manual_seed(0)
    strategy = sys.argv[2] if len(sys.argv) > 2 else os.environ.get("CHECKPOINT_COSTS_STRATEGY", "auto")
    model = s.model(wl.build(), strategy=strategy)
    opt = wl.optimizer(model.parameters())
    x, y = wl.sample(torch.Generator().manual_seed(s.rank), wl.global_batch // s.world_size)

    def step() -> None:
        s.backward(wl.loss(model(x), y))
        s.step(opt)

    return model, opt, step


def agree(s, blocks: int = 12, per_block: int = 30) -> None:
    model, opt, step = _setup(s, "cnn")
    root = ROOT / "agree"  # never written: every=10**9
    n = 0
    for n in range(1, 21):  # warm-up, including the first call (it installs the signal handlers)
        step()
        s.save(root, model=model, optimizer=opt, step=n, every=10**9)
    plain, with_call, inside = [], [], []
    for b in range(blocks):
        for _ in range(per_block):
            t0 = time.perf_counter()
            step()
            if b % 2:
                n += 1
                t1 = time.perf_counter()
                s.save(root, model=model, optimizer=opt, step=n, every=10**9)
                inside.append(time.perf_counter() - t1)
                with_call.append(time.perf_counter() - t0)
            else:
                plain.append(time.perf_counter() - t0)
    p, w, i = (statistics.median(v) * 1e3 for v in (plain, with_call, inside))
    mean = statistics.mean(inside) * 1e3
    slowest = sorted(round(t * 1e6) for t in inside)[-5:]
    s.print(
        f"agree: step {p:.3f} ms without, {w:.3f} ms with s.save(every=); inside the call: median "
        f"{i * 1e3:.1f} us, mean {mean * 1e3:.1f} us = {100 * mean / p:.2f}% of a step "
        f"({len(plain)} + {len(with_call)} steps; slowest calls {slowest} us)"
    )


def _rss() -> int:
    """This process's resident memory in bytes (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def save(s, windows: int = 5, width: int = 6) -> None:
    model, opt, step = _setup(s, "mlp")
    root = ROOT / "save"  # the same folder on every rank
    if s.is_main:
        shutil.rmtree(root, ignore_errors=True)
    s.barrier()
    for _ in range(3):
        step()
    times: dict[str, list[float]] = {"none": [], "sync": [], "background": []}
    inside: dict[str, list[float]] = {"sync": [], "background": []}
    tail: list[float] = []
    held: list[int] = []
    for _ in range(windows):
        for kind in times:
            s.barrier()
            t0 = time.perf_counter()
            for i in range(width):
                step()
                if i == 0 and kind != "none":
                    before, t2 = _rss(), time.perf_counter()
                    s.save(root, model=model, optimizer=opt, step=i, keep=1, background=kind == "background")
                    inside[kind].append(time.perf_counter() - t2)
                    if kind == "background":
                        held.append(_rss() - before)
            s.barrier()
            times[kind].append(time.perf_counter() - t0)
            t1 = time.perf_counter()
            s.checkpoints.wait()
            if kind == "background":
                tail.append(time.perf_counter() - t1)
    base = statistics.median(times["none"])
    lost = {k: [t - base for t in v] for k, v in times.items() if k != "none"}
    med = {k: statistics.median(v) for k, v in lost.items()}

    def spread(v: list[float]) -> str:
        return f"[{min(v):.2f}..{max(v):.2f}]"

    weights = sum(t.numel() * t.element_size() for t in model.parameters())
    share = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values() if t.dim())
    calls = {k: statistics.median(v) for k, v in inside.items()}
    s.print(
        f"save ({s.strategy.name}, {s.world_size} ranks x {torch.get_num_threads()} threads, writer nice "
        f"{os.environ.get('DDPKIT_WRITER_NICE', '19')}): window of {width} steps {base:.2f} s "
        f"{spread(times['none'])}; training time lost per save: sync {med['sync']:.2f} s "
        f"{spread(lost['sync'])}, background {med['background']:.2f} s {spread(lost['background'])} "
        f"({100 * med['background'] / med['sync']:.0f}% of sync); inside the call: sync "
        f"{calls['sync']:.2f} s, background {calls['background']:.2f} s; write still running after "
        f"the window: median {statistics.median(tail):.2f} s; rank 0 holds {weights / 2**20:.0f} MiB "
        f"of weights and {share / 2**20:.0f} MiB of its optimizer state on this rank; RSS growth in a "
        f"background call {statistics.median(held) / 2**20:.0f} MiB ({windows} windows)"
    )


if __name__ == "__main__":
    with ddpkit.session(seed=0, verbose=True) as session:
        {"agree": agree, "save": save}[sys.argv[1]](session)
