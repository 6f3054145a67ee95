"""An elastic run for tests/test_elastic.py, under `ddpkit run --nnodes MIN:MAX` (or `--nproc N`).

    ddpkit run ... tests/elastic_train.py CKPT OUT [--sleep S [--sleep-at-world W]] [--hold W:N ...]
        [--loop accumulate|step|plain|invariant] [--idiom every|if] [--save-every N] [--strategy NAME]

96 samples, global batch 8, 2 epochs: 24 optimizer steps, a checkpoint after each (--save-every N:
every N-th, by `s.save(..., every=N)` after every step, or with --idiom if, `if step % N == 0: s.save`). The world size may
change between restarts; ddpkit keeps the global batch (8): by accumulating more (`ddpkit run
--elastic-batch per-rank`, the loop must accumulate) or with a larger per-rank batch (the default
for a session without accumulation=, `docs/fault-tolerance.md`). --loop: "accumulate" (`with
s.accumulate(model)`, the default), "step" (`s.backward(loss); s.step(opt)`, no block) or "plain"
(the README's first loop: `opt.zero_grad(); loss.backward(); opt.step()`, nothing of ddpkit's) or
"invariant" (`reproducible="any-world", chunk=4`: `s.invariant.step`, 2 chunks per global batch).
--sleep S pauses S seconds after each step (a node leaves or joins mid-run); with --sleep-at-world W only
while the world size is W (the steps after the change need no pause: nothing changes again).
--hold W:N (repeatable): at world size W, right after step N (its save included), wait (in barriers) until
the world changes (a host joins or is lost): the change then comes mid-run however slow the machine is,
never after the end, and never during a save (a host lost while the other waits for its part of a
checkpoint is noticed only after 60 s of silence, `ddpkit.cluster.lifecycle.SILENT_AFTER`). Only at step N
exactly, so that `--hold 2:8 --hold 1:12` holds at world size 2 until a host is lost, then (resumed from
step 6) at world size 1 until a host joins, and (resumed from step 12) never again.
Unlaunched (`python tests/elastic_train.py`, or `main(argv)` from tests/elastic_reference.py): one process,
world size 1, the uninterrupted reference.
Global rank 0 appends "world accumulation step per-rank-batch" to OUT/steps.txt after each optimizer
step (the accumulation the loop really ran: 1 for "plain") and writes OUT/final.safetensors at the end.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

EPOCHS, SAMPLES, GLOBAL_BATCH = 2, 96, 8


def _hold(text: str) -> tuple[int, int]:
    world, step = text.split(":")
    return int(world), int(step)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("out")
    ap.add_argument("--sleep", type=float, default=0.3)
    ap.add_argument("--sleep-at-world", type=int, default=None)
    ap.add_argument("--hold", type=_hold, action="append", default=[])
    ap.add_argument("--loop", choices=("accumulate", "step", "plain", "invariant"), default="accumulate")
    ap.add_argument("--idiom", choices=("every", "if"), default="every")
    ap.add_argument("--save-every", type=int, default=1)
    ap.add_argument(
        "--strategy", default="auto"
    )  # e.g. "hsdp": a replica per host (tests/test_hsdp_elastic.py)
    ns = ap.parse_args(argv)
    torch.set_num_threads(1)
    invariant = {"reproducible": "any-world", "chunk": 4} if ns.loop == "invariant" else {}
    with ddpkit.session(seed=0, strategy=ns.strategy, **invariant) as s:
        g = torch.Generator().manual_seed(42)
        x = torch.randn(SAMPLES, 6, generator=g)
        data = TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())
        model = s.model(nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        loader = s.loader(data, batch_size=GLOBAL_BATCH, shuffle=True)
        state = dict(model=model, optimizer=opt, loader=loader)
        if invariant:
            state["invariant"] = s.invariant  # its step counter seeds the chunks' draws
        step = s.load(ns.ckpt, **state, step=0)["step"]
        log = Path(ns.out) / "steps.txt"
        for _epoch in range(loader.epoch, EPOCHS):
            for xb, yb in loader:
                if ns.loop == "plain":  # the README's first loop
                    loss = F.cross_entropy(model(xb), yb)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                elif ns.loop == "invariant":  # bitwise the same weights at world size 1 or 2
                    s.invariant.step(model, opt, (xb, yb), lambda m, b: F.cross_entropy(m(b[0]), b[1]))
                elif ns.loop == "step":
                    s.backward(F.cross_entropy(model(xb), yb))
                    if not s.step(opt).stepped:
                        continue
                else:
                    with s.accumulate(model):  # see ddpkit.data.elastic_accumulation
                        s.backward(F.cross_entropy(model(xb), yb))
                    if not s.step(opt).stepped:
                        continue
                step += 1
                if s.is_main:
                    ran = 1 if ns.loop == "plain" else s.accumulation  # what this loop really accumulated
                    with open(log, "a") as f:
                        f.write(f"{s.world_size} {ran} {step} {len(xb)}\n")
                if ns.idiom == "every":
                    s.save(ns.ckpt, **state, step=step, every=ns.save_every)
                elif step % ns.save_every == 0:
                    s.save(ns.ckpt, **state, step=step)
                if ns.sleep_at_world in (None, s.world_size):
                    time.sleep(ns.sleep)  # long enough steps for a node to leave or join mid-run
                while (s.world_size, step) in ns.hold:
                    # until the world changes: a joining host makes the agent restart this worker (SIGTERM);
                    # a lost host fails this barrier (as it would the next step's all-reduce), and the agent
                    # restarts the survivors
                    s.barrier()
                    time.sleep(0.1)
        final = str(Path(ns.out) / "final.safetensors")
        if (
            s.strategy.shards_state
        ):  # FSDP/HSDP: the whole weights gathered from the shards, written by rank 0
            s.export(final, model)
        elif s.is_main:
            weights = {k: v.contiguous() for k, v in ddpkit.unwrap(model).state_dict().items()}
            save_file(weights, final)


if __name__ == "__main__":
    main()
