"""A tiny FSDP run that resumes from and saves to CKPT, for tests/test_run_reports.py (`ddpkit run`).

    ddpkit run --nproc 2 tests/refusal_train.py CKPT [--die-at STEP:RANK:SIGNAL[,STEP:RANK:SIGNAL...]]

Two optimizer steps from wherever CKPT says, saving after each. --die-at makes global rank RANK end
itself with SIGNAL (e.g. KILL; RAISE: an exception) at optimizer step STEP; the Nth entry on attempt N
(TORCHELASTIC_RESTART_COUNT N-1) only, so that the attempt after the last entry finishes.
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
import torch.nn.functional as F
from torch import nn

import ddpkit


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("--strategy", default="fsdp")
    ap.add_argument("--die-at", default=None)
    args = ap.parse_args()
    plants = args.die_at.split(",") if args.die_at else []
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    die = plants[attempt].split(":") if attempt < len(plants) else None
    with ddpkit.session(seed=0, strategy=args.strategy) as s:
        model = s.model(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        start = s.load(args.ckpt, model=model, optimizer=opt, step=0)["step"]
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
        step = start
        for step in range(start + 1, start + 3):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            s.backward(loss)
            s.step(opt)
            if die and int(die[0]) == step and s.rank == int(die[1]):
                if die[2] == "RAISE":
                    raise RuntimeError(f"planted failure on rank {s.rank}")
                os.kill(os.getpid(), signal.Signals[f"SIG{die[2]}"])
            s.save(args.ckpt, model=model, optimizer=opt, step=step)
        s.print(f"done at step {step}")


if __name__ == "__main__":
    main()
