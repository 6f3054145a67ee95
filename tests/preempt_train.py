"""A small preemptible run for tests/test_preemption.py, under `ddpkit run --nproc 2`.

    ddpkit run --nproc 2 tests/preempt_train.py CKPT OUT [--signal-at PHASE:STEP:RANK[:WHO]]
        [--idiom every|if|none] [--save-every N] [--loop step|plain]

96 samples, global batch 12, 3 epochs: 24 optimizer steps, `s.save(..., every=5)` after each. With
--signal-at, global rank RANK sends a signal at optimizer step STEP, in PHASE (forward, backward,
optimizer, save: inside the next save's capture, on rank 0). WHO is "launcher" (SIGTERM to the
launcher's process group, the default), "self" (the preemption signal to this rank only: its peer
learns of it only through the agreement) or a signal name such as USR1 (that signal to the launcher
alone, as Slurm's --signal=USR1@120 sends it), or "group-NAME" (that signal to the srun-like launch's
process group, `step_group`: every rank, which the test starts in one group, as Slurm signals a step's
tasks). With --slow-save S, the save that follows the signal takes S seconds longer on the signalling rank
(a save longer than `ddpkit run --grace`); with --second-signal, rank 0 SIGTERMs the launcher again in the
middle of that save. Rank 0 writes OUT/final.safetensors at the end, and every launch appends "start END"
lines to OUT/log.txt (the steps it began from and reached).

--idiom: "every" (the default) calls `s.save(..., every=N)` after every step; "if" saves like the README's
checkpoint section, `if step % N == 0: s.save(...)` (N from --save-every, default 5); "none" never
passes its state to s.load or s.save (ddpkit can only say what to add). --loop plain trains like the
README's first loop (`loss.backward(); opt.step(); opt.zero_grad()`, no s.backward or s.step).
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

EPOCHS, SAMPLES, GLOBAL_BATCH = 3, 96, 12
LAUNCHER_FILE_ENV = "PREEMPT_TRAIN_LAUNCHER_FILE"  # a file holding the launcher's pid (else: the parent)


def launcher() -> int:
    """The launcher's pid: the one in $PREEMPT_TRAIN_LAUNCHER_FILE, which the test writes once it has started
    `ddpkit run` (a rank forked by a warm-start server has that server as its parent), else the parent."""
    path = os.environ.get(LAUNCHER_FILE_ENV)
    if not path:
        return os.getppid()
    deadline = time.monotonic() + 30
    while not Path(path).exists():  # written right after the launcher started, renamed into place
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} was not written within 30 s")
        time.sleep(0.05)
    return int(Path(path).read_text())


def step_group() -> int:
    """The process group of an srun-like launch's tasks: the one in $PREEMPT_TRAIN_LAUNCHER_FILE when the
    test wrote it (a rank forked by a warm-start server runs in a group of its own; its client, which
    passes every signal on to it, is the task in the step's group), else this process's own."""
    return launcher() if os.environ.get(LAUNCHER_FILE_ENV) else os.getpgrp()


class Probe:
    """Shared state that can send the signal from inside a save (its state_dict runs in the save)."""

    def __init__(self, fire, fired: list, slow_save: float = 0.0, again=None) -> None:
        self.fire, self.saves, self.fired, self.slow_save, self.again = fire, 0, fired, slow_save, again

    def state_dict(self) -> dict:
        self.saves += 1
        self.fire("save")
        if self.fired and self.again is not None:  # a second signal, in the middle of the preemption's save
            self.again()
            self.again = None
        if self.fired and self.slow_save:  # the preemption's save, on the rank that signalled
            time.sleep(self.slow_save)
        return {"saves": self.saves}

    def load_state_dict(self, state: dict) -> None:
        self.saves = int(state["saves"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("out")
    ap.add_argument("--signal-at", default=None)
    ap.add_argument("--sleep", type=float, default=0.04)
    ap.add_argument("--slow-save", type=float, default=0.0)
    ap.add_argument("--idiom", choices=("every", "if", "none"), default="every")
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--loop", choices=("step", "plain"), default="step")
    ap.add_argument("--second-signal", action="store_true", help="SIGTERM the launcher again in the save")
    ns = ap.parse_args()
    torch.set_num_threads(1)
    with ddpkit.session(seed=0, verbose=True) as s:
        at = ns.signal_at.split(":") if ns.signal_at else None
        step = 0
        fired = []

        def fire(phase: str) -> None:
            if at and not fired and phase == at[0] and step >= int(at[1]) and s.rank == int(at[2]):
                fired.append(phase)
                who = at[3] if len(at) > 3 else "launcher"
                if who == "self":
                    os.kill(os.getpid(), signal.SIGUSR1)
                elif who.startswith("group-"):  # every rank at once (no launcher: an srun-like start)
                    os.killpg(step_group(), getattr(signal, f"SIG{who.removeprefix('group-')}"))
                elif who != "launcher":  # the launcher alone, the signal a scheduler sends it
                    os.kill(launcher(), getattr(signal, f"SIG{who}"))
                elif os.getpgid(launcher()) == launcher():  # the launcher leads its own group
                    os.killpg(launcher(), signal.SIGTERM)
                else:
                    os.kill(launcher(), signal.SIGTERM)

        g = torch.Generator().manual_seed(42)
        x = torch.randn(SAMPLES, 6, generator=g)
        data = TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())
        net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
        net[0].register_forward_hook(lambda *a: fire("forward"))
        net[0].weight.register_hook(lambda grad: fire("backward"))
        model = s.model(net)
        opt = torch.optim.AdamW(model.parameters(), lr=0.02)
        opt.register_step_pre_hook(lambda *a: fire("optimizer"))
        loader = s.loader(data, batch_size=GLOBAL_BATCH, shuffle=True)

        def again() -> None:
            os.kill(launcher(), signal.SIGTERM)

        probe = Probe(fire, fired, ns.slow_save, again if ns.second_signal else None)
        state = dict(model=model, optimizer=opt, loader=loader, probe=probe)
        step = start = s.load(ns.ckpt, **state, step=0)["step"] if ns.idiom != "none" else 0
        for _epoch in range(loader.epoch, EPOCHS):
            for xb, yb in loader:
                xb = xb + 0.05 * torch.from_numpy(np.random.randn(*xb.shape).astype(np.float32))
                if ns.loop == "plain":  # the README's first loop: ddpkit owns only the loader's batches
                    F.cross_entropy(model(xb), yb).backward()
                    opt.step()
                    opt.zero_grad()
                else:
                    s.backward(F.cross_entropy(model(xb), yb))
                    s.step(opt)
                step += 1
                time.sleep(ns.sleep)  # a step long enough for the signal to arrive mid-run
                if ns.idiom == "every":
                    s.save(ns.ckpt, **state, step=step, every=ns.save_every)
                elif ns.idiom == "if" and step % ns.save_every == 0:
                    s.save(ns.ckpt, **state, step=step)
        if s.is_main:
            with open(Path(ns.out) / "log.txt", "a") as f:
                f.write(f"{start} {step}\n")
            weights = {k: v.contiguous() for k, v in model.module.state_dict().items()}
            save_file(weights, str(Path(ns.out) / "final.safetensors"))


if __name__ == "__main__":
    main()
