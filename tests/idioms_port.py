"""A training loop of the shape of a widely used GPT script, ported to ddpkit, in four variants
(`--shape`), for `ddpkit verify --resume-script` (tests/test_verify_script_resume.py), stopped as kill -9
or as a preemption (`s.save(..., every=)` after every iteration: a preemption saves the current state):

    good      each micro-step draws its batch; the evaluation draws from a generator of its own
    prefetch  the next batch is drawn inside the micro-step (before the save point) and never saved
    per-rank  the same prefetch, its batch saved with s.save(..., X=X, Y=Y): kept per rank, resumes
    eval      the evaluation at every save draws from the global generator (again at the resumed step)
"""

import argparse

import torch
from torch import nn

import ddpkit

p = argparse.ArgumentParser()
p.add_argument("--out", default="ckpt")
p.add_argument("--shape", default="good", choices=["good", "prefetch", "per-rank", "eval"])
p.add_argument("--iters", type=int, default=6)
p.add_argument("--every", type=int, default=2)
a = p.parse_args()
DATA = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))
PREFETCH = a.shape in ("prefetch", "per-rank")


def get_batch(generator=None):
    ix = torch.randint(len(DATA), (4,), generator=generator)
    return DATA[ix], DATA[ix].sum(1, keepdim=True)


@torch.no_grad()
def evaluate(model):
    own = None if a.shape == "eval" else torch.Generator().manual_seed(7)
    return sum(nn.functional.mse_loss(model(x), y) for x, y in (get_batch(own) for _ in range(3)))


with ddpkit.session(seed=1, accumulation=2, verbose=False) as s:
    model = s.model(nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    X, Y = get_batch()
    kept = {"X": X, "Y": Y} if a.shape == "per-rank" else {}
    values = s.load(a.out, model=model, optimizer=opt, step=0, **kept)
    it = values["step"]
    X, Y = (values["X"], values["Y"]) if kept else (X, Y)
    while it < a.iters:
        if it % a.every == 0:
            s.print(f"it {it}: val {float(evaluate(model)):.4f}")
        # called every iteration, written every `every`: what a preemption saves is the current state
        s.save(
            a.out, model=model, optimizer=opt, step=it, every=a.every, **({"X": X, "Y": Y} if kept else {})
        )
        for _micro in range(2):
            with s.accumulate(model):
                if not PREFETCH:
                    X, Y = get_batch()
                loss = nn.functional.mse_loss(model(X), Y)
                if PREFETCH:
                    X, Y = get_batch()
                s.backward(loss)
            s.step(opt)  # after every block: it steps on the last of the 2
        it += 1
    s.save(a.out, model=model, optimizer=opt, step=it, **({"X": X, "Y": Y} if kept else {}))
