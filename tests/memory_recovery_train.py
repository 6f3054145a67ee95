"""One small run recovered from memory snapshots, for tests/test_memory_recovery*.py: in the rank pools
(the uninterrupted reference) and as a script under `ddpkit run` (the faults).

    ddpkit run --nproc 4 --max-restarts 1 tests/memory_recovery_train.py OUT --strategy fsdp --kill-at 7

State: weights and AdamW moments (FSDP: each rank's shards), an LR schedule, the loader's position,
every rank's torch (dropout), numpy and Python RNG streams. 96 samples, global batch 16: 6 steps an
epoch, 2 epochs, 12 steps. A snapshot after every optimizer step, held by the keeper named by
--keeper (or `ddpkit run`'s, DDPKIT_KEEPER). The faults: --kill-at K SIGKILLs --kill-rank in step K
(after its backward: step K is lost); --kill-mid-snapshot K SIGKILLs it halfway through copying the
snapshot of step K. Each rank writes OUT/rank{r}.pt at the end; global rank 0 OUT/resumed.txt (the
step restored) after a restart, and the killed rank OUT/killed.txt.
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
from ddpkit.checkpoint.memory import MemorySnapshots, Slot
from ddpkit.strategy import HSDPOptions

EPOCHS, SAMPLES, GLOBAL_BATCH = 2, 96, 16
MID = 10  # of the snapshot's tensors: RNG, loader, the model's 6, then the optimizer's


def make_data() -> TensorDataset:
    g = torch.Generator().manual_seed(42)
    x = torch.randn(SAMPLES, 8, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())


def net() -> nn.Module:
    return nn.Sequential(
        nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3)
    )


def _restarted() -> bool:
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"


def kill_mid_copy(step: int, out: str | None) -> None:
    """The fault inside a snapshot: this process SIGKILLs itself in the middle of copying `step`'s (its
    model shards written, its optimizer state not: MID tensors in). A seam of this script: it wraps the
    class's save and tensor copy, whoever takes the snapshot (this script, or `s.load(..., memory=)`)."""
    write, save, count, current = MemorySnapshots.write_tensor, MemorySnapshots.save, [0], [-1]

    def saving(self: MemorySnapshots, at: int, *args: Any) -> None:
        current[0], count[0] = at, 0
        save(self, at, *args)

    def writing(self: MemorySnapshots, slot: Slot, offset: int, t: torch.Tensor) -> None:
        count[0] += 1
        if current[0] == step and count[0] == MID:
            Path(out or ".", "killed.txt").write_text(f"{time.time()} {step} mid-snapshot")
            os.kill(os.getpid(), signal.SIGKILL)
        write(self, slot, offset, t)

    MemorySnapshots.save, MemorySnapshots.write_tensor = saving, writing  # type: ignore[method-assign]


def _augment(x: torch.Tensor) -> torch.Tensor:
    x = x + 0.05 * torch.from_numpy(np.random.randn(*x.shape).astype(np.float32))
    return x * 1.01 if random.random() < 0.5 else x


def _fit(
    s: Any, model: Any, opt: Any, sched: Any, loader: Any, step: int, kill_at: Any, rank: int, out: Any
) -> int:
    """The rest of the run under `ddpkit.fit` (its own loop: the scheduler after each step); the step."""
    done = [step]

    def train_step(module: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        if kill_at == done[0] + 1 and s.rank == rank and not _restarted():
            Path(out or ".", "killed.txt").write_text(f"{time.time()} {done[0] + 1}")
            os.kill(os.getpid(), signal.SIGKILL)
        done[0] += 1
        return F.cross_entropy(module(_augment(x)), y)

    total = EPOCHS * SAMPLES // GLOBAL_BATCH
    if total > step:
        ddpkit.fit(
            s,
            model,
            opt,
            loader,
            train_step,
            max_steps=total - step,
            scheduler=sched,
            progress=False,
            flops=None,
        )
    return total


def train(
    keeper: str | None,
    out: str | None,
    strategy: str = "fsdp",
    kill_at: int | None = None,
    kill_rank: int = 1,
    kill_mid: int | None = None,
    ckpt: str | None = None,
    disk_every: int = 0,
    peers: tuple[tuple[str, str], ...] = (),
    step_sleep: float = 0.0,
    memory: int | str = 0,
    fit_loop: bool = False,
    buddy: str = "behind",
) -> dict[str, Any]:
    """Train 12 steps; with `keeper`, restore the newest snapshot all ranks hold first; with `ckpt`
    (today's disk path, for the benchmark), `s.load` it first and `s.save` every `disk_every` steps.
    `peers`: other hosts' keepers ((TCP HOST:PORT, job token)), asked when this host's keeper lacks this rank's snapshots (a
    replacement host); `step_sleep`: seconds added to every step (a fault from outside lands mid-run);
    `memory`: the product's way instead, `s.load(ckpt, ..., memory=N)` under `ddpkit run` (its keeper;
    across hosts its buddy wiring; "auto" too), `buddy` its copy mode (`s.load(..., buddy=)`);
    `fit_loop`: the same steps under `ddpkit.fit` instead of the plain loop.
    Returns this rank's final state (full weights, its optimizer state, RNG, step, LR)."""
    torch.set_num_threads(1)
    with ddpkit.session(seed=0, verbose=out is not None) as s:
        layout = HSDPOptions(replicate=2, shard=2) if strategy == "hsdp-2x2" else strategy
        model = s.model(net(), strategy=layout)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
        loader = s.loader(make_data(), batch_size=GLOBAL_BATCH, shuffle=True)
        state: dict[str, Any] = {"model": model, "optimizer": opt, "scheduler": sched, "loader": loader}
        owner = s.checkpoints._ctx.strategy
        values: dict[str, Any] = {"step": 0}
        snaps = MemorySnapshots.attach(keeper, s.rank, s.world_size, peers) if keeper else None
        if snaps is not None:
            target = snaps.agree(distributed=s.world_size > 1, device=s.device)
            if target is not None:
                values = snaps.restore(target, owner, {**state, **values})
        if kill_mid is not None and s.rank == kill_rank and not _restarted():
            kill_mid_copy(kill_mid, out)
        if memory:
            root = ckpt or str(Path(out or ".", "ckpt"))
            values = s.load(root, **state, **values, memory=memory, buddy=buddy)
        elif ckpt:
            values = s.load(ckpt, **state, **values)
        if out and (values["step"] or _restarted()) and s.rank == 0:  # a restart, or a new host restored
            Path(out, "resumed.txt").write_text(f"{time.time()} {values['step']}")
        step = values["step"]
        if fit_loop:
            step = _fit(s, model, opt, sched, loader, step, kill_at, kill_rank, out)
        for _ in range(loader.epoch, EPOCHS):
            for x, y in loader:
                x = x + 0.05 * torch.from_numpy(np.random.randn(*x.shape).astype(np.float32))
                if random.random() < 0.5:
                    x = x * 1.01
                loss = F.cross_entropy(model(x), y)
                if out and s.rank == 0:  # under FSDP every rank has begun this step (its all-gather)
                    with open(Path(out, "forward.txt"), "a") as f:
                        f.write(f"{time.time()} {step + 1}\n")
                s.backward(loss)
                if kill_at == step + 1 and s.rank == kill_rank and not _restarted():
                    Path(out or ".", "killed.txt").write_text(f"{time.time()} {step + 1}")
                    os.kill(os.getpid(), signal.SIGKILL)
                s.step(opt)
                sched.step()
                step += 1
                if snaps is not None:
                    snaps.save(step, owner, {**state, "step": step})
                if ckpt:
                    s.save(ckpt, **state, step=step, every=disk_every)
                time.sleep(step_sleep)
                if out and s.rank == 0:
                    with open(Path(out, "steps.txt"), "a") as f:
                        f.write(f"{time.time()} {step} {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}\n")
        full = {}
        for name, p in ddpkit.unwrap(model).named_parameters():
            t = p.detach()
            full[name] = (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()
        moments = {
            f"{i}/{k}": (v.to_local() if hasattr(v, "to_local") else v).clone()
            for i, st in enumerate(opt.state.values())
            for k, v in st.items()
        }
        result = {"weights": full, "opt": moments, "rng": torch.get_rng_state(), "step": step}
        result["lr"] = sched.get_last_lr()
        if snaps is not None:
            s.barrier()
            snaps.drop()
            snaps.close()
        if out:
            torch.save(result, Path(out, f"rank{s.rank}.pt"))
        return result


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--keeper", default=None)
    p.add_argument("--strategy", default="fsdp")
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--kill-mid-snapshot", type=int, default=None)
    p.add_argument("--ckpt", default=None)
    p.add_argument("--disk-every", type=int, default=0)
    p.add_argument("--peers", default="")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--memory", type=lambda v: v if v == "auto" else int(v), default=0)
    p.add_argument("--fit", action="store_true")
    p.add_argument("--buddy", default="behind")
    a = p.parse_args()
    peers = tuple(tuple(p.split("@")[::-1]) for p in filter(None, a.peers.split(",")))  # TOKEN@HOST:PORT
    fault = (a.kill_at, a.kill_rank, a.kill_mid_snapshot)
    train(
        a.keeper,
        a.out,
        a.strategy,
        *fault,
        a.ckpt,
        a.disk_every,
        peers,
        a.step_sleep,
        a.memory,
        a.fit,
        a.buddy,
    )
