"""A small run on an iterable source (2 DataLoader workers, shuffle buffer), shared by the stream
resume test in the rank pool (uninterrupted) and under `ddpkit run` (killed, restarted, resumed):

    ddpkit run --nproc 2 --max-restarts 1 tests/stream_train.py CKPT OUT --every 3 --kill-at 8

61 samples, global batch 12: 6 steps per epoch (the last one the padded tail), 2 epochs.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import IterableDataset

import ddpkit

N, GLOBAL_BATCH, EPOCHS = 61, 12, 2


class Numbers(IterableDataset):
    """(feature, id) for ids 0..n-1: the same sequence in every process."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        for i in range(self.n):
            yield torch.full((3,), float(i) / self.n), i


def train(
    ckpt: str | None, every: int = 0, kill_at: int | None = None, out: str | None = None
) -> dict[str, Any]:
    torch.set_num_threads(1)
    with ddpkit.session(seed=0) as s:
        model = s.model(nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        # fork: in the pool's spawned processes the default would start each worker as a new interpreter
        loader = s.loader(
            Numbers(N),
            batch_size=GLOBAL_BATCH,
            shuffle=True,
            shuffle_buffer=16,
            num_workers=2,
            multiprocessing_context="fork",
        )
        step = s.load(ckpt, model=model, optimizer=opt, loader=loader, step=0)["step"] if ckpt else 0
        seen = []
        for _ in range(loader.epoch, EPOCHS):
            for x, ids in loader:
                opt.zero_grad()
                s.backward(model(x).pow(2).mean())
                opt.step()
                step += 1
                seen.append(ids.tolist())
                if kill_at == step and s.rank == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
                    Path(out or ".", "killed.txt").write_text(str(step))
                    os.kill(os.getpid(), signal.SIGKILL)
                if every and step % every == 0:
                    s.save(ckpt, model=model, optimizer=opt, loader=loader, step=step)
        params = {k: v.clone() for k, v in ddpkit.unwrap(model).state_dict().items()}
        return {"params": params, "seen": seen, "step": step, "rank": s.rank}


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("ckpt")
    p.add_argument("out")
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--kill-at", type=int, default=None)
    a = p.parse_args()
    result = train(a.ckpt, every=a.every, kill_at=a.kill_at, out=a.out)
    torch.save(result, Path(a.out, f"rank{result['rank']}.pt"))
