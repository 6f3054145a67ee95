"""A 2-rank run that logs every step to TensorBoard, MLflow and W&B (offline), saves every 3 steps,
and (first attempt only) has global rank 0, the writer, SIGKILL itself right after logging step KILL.

    ddpkit run --nproc 2 --max-restarts 1 tests/tracking_train.py OUT --kill-at 8 --steps 12

The restart resumes from the checkpoint of step 6 and logs 7..12 again into the same runs.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import ddpkit


def main(out: str, kill_at: int, steps: int) -> None:
    torch.set_num_threads(1)
    with ddpkit.session(seed=0, log_to=["tensorboard", "mlflow", "wandb"], log_dir=f"{out}/run") as s:
        model = s.model(nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        values = s.load(f"{out}/ckpt", model=model, optimizer=opt, step=0)
        step = values["step"]
        g = torch.Generator().manual_seed(s.rank)
        while step < steps:
            x = torch.randn(8, 4, generator=g)
            loss = F.mse_loss(model(x), x.sum(1, keepdim=True))
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            s.log({"loss": s.all_reduce(loss.detach(), op="mean").item()}, step=step)
            if step == kill_at and s.rank == 0 and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
                Path(out, "killed.txt").write_text(str(step))
                os.kill(os.getpid(), signal.SIGKILL)
            if step % 3 == 0:
                s.save(f"{out}/ckpt", model=model, optimizer=opt, step=step)
        Path(out, f"rank{s.rank}-trackers.txt").write_text(",".join(s.tracking.trackers))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--kill-at", type=int, default=0)
    p.add_argument("--steps", type=int, default=12)
    a = p.parse_args()
    main(a.out, a.kill_at, a.steps)
