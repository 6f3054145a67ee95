"""One small resumable training run, shared by the resume tests (in the rank pool) and the fault tests
(as a script under `ddpkit run`), so both compare against the same uninterrupted reference.

    ddpkit run --nproc 2 --max-restarts 1 tests/resume_train.py CKPT OUT --every 3 --kill-at 14

It uses all four kinds of state a resume must restore: weights and AdamW moments, an LR schedule,
the position inside the epoch, and the torch (dropout), numpy and Python RNG streams of every rank.
96 samples, global batch 12: 8 steps per epoch, 3 epochs, 24 steps.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

EPOCHS, SAMPLES, GLOBAL_BATCH = 3, 96, 12


def make_data() -> TensorDataset:
    g = torch.Generator().manual_seed(42)
    x = torch.randn(SAMPLES, 6, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long(), torch.arange(SAMPLES))


def train(
    ckpt: str | None,
    stop: tuple[str, int] | None = None,
    workers: int = 0,
    *,
    position: bool = True,
    scramble: bool = False,
    every: int = 0,
    kill_at: int | None = None,
    out: str | None = None,
    verbose: bool = False,
) -> dict[str, Any] | None:
    """Train; with `ckpt`, resume from its newest checkpoint first. `stop` = ("step", n) or
    ("epoch_end", e): save there and return None. Returns the final state of this rank."""
    torch.set_num_threads(1)
    if scramble:  # a resumed run must not depend on what this process did before
        torch.manual_seed(12345), np.random.seed(12345), random.seed(12345)
    with ddpkit.session(seed=0, verbose=verbose) as s:
        model = s.model(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3)))
        opt = torch.optim.AdamW(model.parameters(), lr=0.02)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)
        # fork: in the pool's spawned processes the default would start each worker as a new interpreter
        context = {"multiprocessing_context": "fork"} if workers else {}
        loader = s.loader(make_data(), batch_size=GLOBAL_BATCH, shuffle=True, num_workers=workers, **context)
        things = {"model": model, "optimizer": opt, "scheduler": sched}
        if position:
            things["loader"] = loader
        values = {"step": 0, "epoch": 0}
        if ckpt:
            values = s.load(ckpt, **things, **values)
            if not position:  # the naive resume: right epoch, but from its first batch
                loader.set_epoch(values["epoch"])
        step, seen = values["step"], []
        if out and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0" and s.rank == 0:
            Path(out, "resumed.txt").write_text(f"{time.time()} {step}")

        def save(epoch: int) -> None:
            s.save(ckpt, **things, step=step, epoch=epoch)

        for epoch in range(loader.epoch, EPOCHS):
            for x, y, idx in loader:
                x = x + 0.05 * torch.from_numpy(np.random.randn(*x.shape).astype(np.float32))
                if random.random() < 0.5:
                    x = -x
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
                step += 1
                seen.append(sorted(idx.tolist()))
                if kill_at == step and s.rank == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
                    Path(out or ".", "killed.txt").write_text(f"{time.time()} {step}")
                    os.kill(os.getpid(), signal.SIGKILL)
                if (every and step % every == 0) or stop == ("step", step):
                    save(epoch)
                if stop == ("step", step):
                    return None
            if stop == ("epoch_end", epoch):
                save(epoch + 1)
                return None
        return {
            "model": {k: v.clone() for k, v in ddpkit.unwrap(model).state_dict().items()},
            "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "numpy_rng": [int(v) for v in np.random.get_state()[1]] + [int(np.random.get_state()[2])],
            "python_rng": random.getstate(),
            "loader_generator": loader.loader.generator.get_state(),
            "step": step,
            "seen": seen,
            "rank": s.rank,
        }


def same(a: Any, b: Any, path: str = "") -> list[str]:
    """The paths where two results differ (bitwise for tensors)."""
    if isinstance(a, torch.Tensor):
        return [] if isinstance(b, torch.Tensor) and torch.equal(a, b) and a.dtype == b.dtype else [path]
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return [path]
        return [d for k in a for d in same(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            return [path]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in same(x, y, f"{path}/{i}")]
    return [] if a == b else [path]


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("ckpt")
    p.add_argument("out")
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--no-position", action="store_true")
    a = p.parse_args()
    result = train(
        a.ckpt, every=a.every, kill_at=a.kill_at, out=a.out, position=not a.no_position, verbose=True
    )
    assert result is not None
    torch.save({k: v for k, v in result.items() if k != "seen"}, Path(a.out, f"rank{result['rank']}.pt"))


_reference: list[dict[str, Any]] = []


def reference(pool: Any) -> list[dict[str, Any]]:
    """The uninterrupted 2-rank run in the rank pool, computed once per test session."""
    if not _reference:
        _reference.extend(pool.run(train, None))
    return _reference


def stop_at(ckpt: str, stop: tuple[str, int], workers: int = 0) -> None:
    """Train from scratch until `stop`, save there, return (for `RankPool.run`, which takes no kwargs)."""
    return train(ckpt, stop, workers)


def resume(ckpt: str, workers: int = 0, position: bool = True) -> dict[str, Any] | None:
    """Resume from the newest checkpoint with scrambled RNGs and fresh objects; train to the end."""
    return train(ckpt, None, workers, position=position, scramble=True)
