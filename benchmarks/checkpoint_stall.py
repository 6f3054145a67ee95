"""What a save costs training, per writer: none, synchronous, a writer thread, a writer process.

    OMP_NUM_THREADS=1 ddpkit run --nproc 2 benchmarks/checkpoint_stall.py            # two busy ranks
    OMP_NUM_THREADS=1 ddpkit run --nproc 1 benchmarks/checkpoint_stall.py            # one rank, a core free
    OMP_NUM_THREADS=1 ddpkit run --nproc 2 benchmarks/checkpoint_stall.py 12 7   # 12 steps, 7 rounds
    OMP_NUM_THREADS=1 ddpkit run --nproc 2 benchmarks/checkpoint_stall.py 12 5 fsdp   # under FSDP
    OMP_NUM_THREADS=1 ddpkit run --nproc 2 benchmarks/checkpoint_stall.py 6 5 fsdp 1  # cores half idle

The 37.8M-parameter MLP with AdamW (global batch 64; `ddpkit.tools.workloads`), DDP (or FSDP: each
rank saves its shards through DCP; the thread writes them in training's process, the process out of
it). Each round runs one
window of W steps of each kind, in turn (interleaved, so drifts in the machine's load hit every kind
alike); a window with a save calls `s.save(..., keep=1)` after its first step (`background=` False,
"thread" or "process"). lost = the window's time minus the median window without a save; a write still
in flight when its window ends is waited for outside the timing and reported as `tail` (its CPU time
after the window is not counted: use wider windows to take it in). Printed: per kind the median lost
[min..max], its share of the synchronous save's, the median time inside the call, the slowest step in
the window minus the median step without a save (the stall of one step), the tail, and the load
average before and after (`os.getloadavg`).

A fourth argument R makes every step wait R times its own median compute time after it (a sleep, which
leaves the core and the interpreter lock free), as a rank waits for its GPU: a node whose CPU cores
are mostly idle, with two FSDP ranks, which one process cannot stand for (with one process `s.model`
uses the model as is: no shards, no DCP).
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

ROOT = Path(tempfile.gettempdir()) / f"ddpkit-checkpoint-stall-{os.getuid()}"
KINDS = {"none": None, "sync": False, "thread": "thread", "process": "process"}


def workload(s, strategy: str = "ddp"):
    """The MLP under DDP (or FSDP), its optimizer and one training step (also checkpoint_threads.py's)."""
    wl = NAMED["mlp"]
    torch.manual_seed(0)
    model = s.model(wl.build(), strategy=strategy)
    opt = wl.optimizer(model.parameters())
    x, y = wl.sample(torch.Generator().manual_seed(s.rank), wl.global_batch // s.world_size)

    def step() -> None:
        s.backward(wl.loss(model(x), y))
        s.step(opt)

    return model, opt, step


def main(s, width: int, rounds: int, strategy: str = "ddp", wait: float = 0.0) -> None:
    model, opt, compute = workload(s, strategy)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        compute()
        times.append(time.perf_counter() - t)
    pause = wait * statistics.median(times)  # the time a GPU would keep this rank waiting per step

    def step() -> None:
        compute()
        if pause:
            time.sleep(pause)

    if s.is_main:
        shutil.rmtree(ROOT, ignore_errors=True)
    s.barrier()
    for kind, mode in KINDS.items():  # warm-up: the first save of each kind (the writer group, the process)
        step()
        if mode is not None:
            s.save(ROOT / kind, model=model, optimizer=opt, step=0, keep=1, background=mode)
            s.checkpoints.wait()
    load_before = os.getloadavg()[0]
    window: dict[str, list[float]] = {k: [] for k in KINDS}
    inside: dict[str, list[float]] = {k: [] for k in KINDS}
    slowest: dict[str, list[float]] = {k: [] for k in KINDS}
    tail: dict[str, list[float]] = {k: [] for k in KINDS}
    plain_steps: list[float] = []

    def summary(done: int) -> None:  # after every round from the second: a cut-off run still reports
        base, step_med = statistics.median(window["none"]), statistics.median(plain_steps)
        lost = {k: [t - base for t in window[k]] for k in KINDS if k != "none"}
        sync = statistics.median(lost["sync"])

        def spread(v: list[float]) -> str:
            return f"{statistics.median(v):.2f} s [{min(v):.2f}..{max(v):.2f}]"

        threads = torch.get_num_threads()
        head = (
            f"checkpoint_stall: {strategy}, {s.world_size} rank(s) x {threads} thread(s), "
            f"windows of {width} steps, {done} of {rounds} rounds, a wait of {pause * 1e3:.0f} ms "
            f"after each step; window without a save "
            f"{spread(window['none'])}, step {step_med * 1e3:.0f} ms; load {load_before:.1f} -> "
            f"{os.getloadavg()[0]:.1f}"
        )
        s.print(head)
        for kind in ("sync", "thread", "process"):
            med, during = statistics.median(lost[kind]), statistics.median(slowest[kind]) - step_med
            s.print(
                f"  {kind:8s} lost {spread(lost[kind])} = {100 * med / sync:.0f}% of sync; in the call "
                f"{statistics.median(inside[kind]):.3f} s; slowest step +{during:.2f} s; "
                f"tail {spread(tail[kind])}"
            )
        # each round's window minus the same round's window without a save (neighbours in time: a drift
        # in the machine's load cancels), median [min..max]; and every window, for other statistics
        paired = {k: [t - n for t, n in zip(window[k], window["none"], strict=True)] for k in lost}
        s.print(
            "  paired with their round's window without a save: "
            + "; ".join(f"{k} {spread(v)}" for k, v in paired.items())
        )
        every = (f"{k} " + " ".join(f"{t:.2f}" for t in v) for k, v in window.items())
        s.print("  windows (s): " + "; ".join(every))

    for r in range(rounds):
        order = list(KINDS) if r % 2 == 0 else list(reversed(KINDS))  # no kind always follows another
        for kind in order:
            mode = KINDS[kind]
            s.barrier()
            steps = []
            t0 = time.perf_counter()
            for i in range(width):
                t1 = time.perf_counter()
                step()
                if i == 0 and mode is not None:
                    t2 = time.perf_counter()
                    s.save(ROOT / kind, model=model, optimizer=opt, step=r + 1, keep=1, background=mode)
                    inside[kind].append(time.perf_counter() - t2)
                steps.append(time.perf_counter() - t1)
            s.barrier()
            window[kind].append(time.perf_counter() - t0)
            t3 = time.perf_counter()
            s.checkpoints.wait()
            tail[kind].append(time.perf_counter() - t3)
            if mode is None:
                plain_steps += steps
            slowest[kind].append(max(steps))
        if r >= 1:
            summary(r + 1)


if __name__ == "__main__":
    width = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    strategy = sys.argv[3] if len(sys.argv) > 3 else "ddp"
    wait = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
    with ddpkit.session(seed=0, verbose=True) as session:
        main(session, width, rounds, strategy, wait)
