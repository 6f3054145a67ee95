"""What checkpoints cost training: the preemption agreement per step, and a save, sync vs background.

    ddpkit run --nproc 2 benchmarks/checkpoint_costs.py agree      # small CNN: s.save(every=) per step
    ddpkit run --nproc 2 benchmarks/checkpoint_costs.py save       # 37.8M MLP: one save per window
    ddpkit run --nproc 2 benchmarks/checkpoint_costs.py save fsdp  # the same under FSDP

agree: steps of the CIFAR tutorial CNN (global batch 64), in interleaved blocks with and without
`s.save(root, ..., step=step, every=10**9)` after each step (which never writes: only the agreement);
reports the median step of each kind and the median time inside that call.
save: windows of W steps of the 37.8M-parameter MLP with AdamW (global batch 64); a window either has
no save, a synchronous save, or a background save at its first step; the training time a save
costs is the window's time minus the median window without a save. A background write still in
flight at the end of its window is waited for outside the timed window (and reported).
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import ddpkit
from ddpkit.workloads import NAMED

ROOT = Path(tempfile.gettempdir()) / "ddpkit-checkpoint-costs"


def _setup(s, name: str):
    wl = NAMED[name]
    torch.manual_seed(0)
    model = s.model(wl.build())
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
    s.print(f"agree: step {p:.3f} ms without, {w:.3f} ms with s.save(every=); inside the call: median "
            f"{i * 1e3:.1f} us, mean {mean * 1e3:.1f} us = {100 * mean / p:.2f}% of a step "
            f"({len(plain)} + {len(with_call)} steps; slowest calls {slowest} us)")  # fmt: skip


def save(s, windows: int = 3, width: int = 6) -> None:
    model, opt, step = _setup(s, "mlp")
    root = ROOT / "save"  # the same folder on every rank
    if s.is_main:
        shutil.rmtree(root, ignore_errors=True)
    s.barrier()
    for _ in range(3):
        step()
    times: dict[str, list[float]] = {"none": [], "sync": [], "background": []}
    tail: list[float] = []
    for _ in range(windows):
        for kind in times:
            s.barrier()
            t0 = time.perf_counter()
            for i in range(width):
                step()
                if i == 0 and kind != "none":
                    s.save(root, model=model, optimizer=opt, step=i, keep=1, background=kind == "background")
            s.barrier()
            times[kind].append(time.perf_counter() - t0)
            t1 = time.perf_counter()
            s.checkpoints.wait()
            if kind == "background":
                tail.append(time.perf_counter() - t1)
    base = statistics.median(times["none"])
    lost = {k: statistics.median(v) - base for k, v in times.items() if k != "none"}
    def nbytes(t: torch.Tensor) -> int:  # this rank's part (FSDP: its shard)
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    state = sum(nbytes(t) for t in model.parameters())
    state += sum(nbytes(t) for st in opt.state.values() for t in st.values() if t.dim())
    s.print(f"save: window of {width} steps {base:.2f} s; training time lost per save: sync "
            f"{lost['sync']:.2f} s, background {lost['background']:.2f} s "
            f"({100 * lost['background'] / lost['sync']:.0f}% of sync); "
            f"write still running after the window: median {statistics.median(tail):.2f} s; "
            f"CPU copy held during a background save: {state / 2**20:.0f} MiB on rank 0 (weights and "
            f"optimizer state{'' if s.strategy.name == 'fsdp' else ', gathered'})")  # fmt: skip


if __name__ == "__main__":
    strategy = sys.argv[2] if len(sys.argv) > 2 else "auto"  # save fsdp: DCP's async_save for the shards
    with ddpkit.session(seed=0, verbose=True, strategy=strategy) as session:
        {"agree": agree, "save": save}[sys.argv[1]](session)
