"""What preemption safety costs a step (issue 32): the small CNN under `ddpkit run --nproc 2`.

    flock /tmp/ddpkit-cpu.lock .venv/bin/ddpkit run --nproc 2 scripts/bench_preemption_step.py [N] [plain]

Once a script has passed its state to `s.load`/`s.save`, every `s.step` counts the call and takes part
in the (usually skipped) preemption agreement (`Checkpoints.stepped`), and every batch of `s.loader`,
every `s.accumulate` and `s.backward` checks the agreed flag (`Checkpoints.stop_at_boundary`). This
runs the CIFAR tutorial CNN (ddpkit.tools.workloads "cnn", global batch 64) through `s.loader` in
interleaved blocks with that state remembered (after `s.load`) and forgotten (as before any), and
reports the median step of each and the time spent inside the two calls, timed one by one, as a
share of the median step. Nothing is written (the checkpoint folder stays empty). With `plain`, the
loop is the README's first (`loss.backward(); opt.step(); opt.zero_grad()`, no s.backward or s.step):
the loader's next batch then also counts the step and takes part in the agreement.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time

import torch
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.tools.workloads import NAMED


def main() -> None:
    blocks = int(sys.argv[1])  # N blocks if len(sys.argv) > 1 else 12
    plain = "plain" in sys.argv[2:]
    per_block = 30
    with ddpkit.session(seed=0, log_to=None) as s:
        wl = NAMED["cnn"]
        model = s.model(wl.build())
        opt = wl.optimizer(model.parameters())
        x, y = wl.sample(torch.Generator().manual_seed(0), wl.global_batch * 8)
        loader = s.loader(TensorDataset(x, y), batch_size=wl.global_batch, shuffle=True)
        root = tempfile.mkdtemp(prefix="ddpkit-bench-stop-")
        s.load(root, model=model, optimizer=opt, loader=loader, step=0)  # remembered from here
        ckpts = s.checkpoints
        remembered = ckpts._remembered
        inside: list[float] = []
        for name in ("stepped", "stop_at_boundary"):  # time each call of the two hooks
            real = getattr(ckpts, name)

            def timed(*args, real=real) -> None:
                t0 = time.perf_counter()
                real(*args)
                if ckpts._remembered is not None:
                    inside.append(time.perf_counter() - t0)

            setattr(ckpts, name, timed)
        loader.boundary = s._boundary  # the loader's hook, re-bound to the timed methods
        steps: dict[bool, list[float]] = {True: [], False: []}
        batches = iter(())
        for b in range(blocks + 2):  # two warm-up blocks
            on = b % 2 == 1
            if b == 2:
                inside.clear()  # the warm-up's calls
            ckpts._remembered = remembered if on else None
            for _ in range(per_block):
                t0 = time.perf_counter()
                batch = next(batches, None)
                if batch is None:
                    batches = iter(loader)
                    batch = next(batches)
                xb, yb = batch
                if plain:
                    wl.loss(model(xb), yb).backward()
                    opt.step()
                    opt.zero_grad()
                else:
                    s.backward(wl.loss(model(xb), yb))
                    s.step(opt)
                if b >= 2:
                    steps[on].append(time.perf_counter() - t0)
        off, on_ = (statistics.median(steps[k]) * 1e3 for k in (False, True))
        per_step = sum(inside) / max(1, len(steps[True]))  # the hooks' time per step with state remembered
        loop = "plain loop" if plain else "s.step loop"
        s.print(
            f"preemption safety ({loop}): step {off:.3f} ms without remembered state, {on_:.3f} ms with "
            f"({len(steps[False])} + {len(steps[True])} steps, median); inside the hooks: median call "
            f"{statistics.median(inside) * 1e6:.1f} us, mean {statistics.mean(inside) * 1e6:.1f} us, "
            f"{per_step * 1e6:.1f} us per step = {100 * per_step / (off / 1e3):.2f}% of the median step; "
            f"slowest calls {sorted(round(t * 1e6) for t in inside)[-5:]} us"
        )


if __name__ == "__main__":
    main()
