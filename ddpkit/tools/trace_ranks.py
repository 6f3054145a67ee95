"""`ddpkit trace --ranks`: every rank's step anatomy side by side over many steps, as a PNG and JSON.

    ddpkit trace --ranks --workload cnn --steps 200
    ddpkit trace --ranks --workload cnn --slow 1:30:data     # plant 30 ms per step in rank 1's loader

Each rank trains the workload with `ddpkit.fit` for `--steps` optimizer steps and returns the phase
times fit recorded for each step (`ddpkit.observe.anatomy`: data wait, forward, backward, the
gradient-sync wait, optimizer, the loop's own work). The picture has one panel per rank, the same
axes, each step a stacked bar: a slow rank's extra phase and the others' matching sync wait line up.
`--slow` plants a delay to see what one looks like (and the slow-rank report fit prints for it).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Any

import torch

from ddpkit.errors import problem
from ddpkit.observe.anatomy import PHASES

COLOURS = {
    "data": "#e15759",
    "forward": "#4e79a7",
    "backward": "#76b7b2",
    "sync": "#f28e2b",
    "optimizer": "#59a14f",
    "other": "#bab0ac",
}


def parse_slow(spec: str | None) -> tuple[int, float, str] | None:
    """ "RANK:MS:data|forward" -> (rank, seconds, where); None for no plant."""
    if not spec:
        return None
    parts = spec.split(":")
    try:
        rank, ms, where = int(parts[0]), float(parts[1]), parts[2]
    except (ValueError, IndexError):
        rank, ms, where = -1, -1.0, ""
    if len(parts) != 3 or where not in ("data", "forward") or rank < 0 or ms < 0:
        raise problem(f"--slow {spec!r} is not RANK:MS:data or RANK:MS:forward", "Pass e.g. --slow 1:30:data")
    return rank, ms / 1e3, where


class _Late:
    """The loader's batches, each `delay` s late (a slow disk feeding this rank)."""

    def __init__(self, loader: Any, delay: float) -> None:
        self.loader, self.delay = loader, delay

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Any:
        for batch in self.loader:
            time.sleep(self.delay)
            yield batch


def rank_main(spec: str, steps: int, slow: tuple[int, float, str] | None) -> dict[str, Any]:
    import ddpkit
    from ddpkit.tools import workloads

    wl = workloads.load(spec)
    with ddpkit.session(seed=0, verbose=False, log_to=None) as s:
        torch.manual_seed(0)
        model = s.model(wl.build())
        opt = wl.optimizer(model.parameters())
        loader: Any = s.loader(wl.dataset(batches=16), batch_size=wl.global_batch, shuffle=True)
        planted = slow is not None and slow[0] == s.rank
        if planted and slow[2] == "data":  # type: ignore[index]
            loader = _Late(loader, slow[1])  # type: ignore[index]

        def train_step(m: torch.nn.Module, batch: Any) -> torch.Tensor:
            loss = wl.step_loss(m, batch)
            if planted and slow[2] == "forward":  # type: ignore[index]
                time.sleep(slow[1])  # type: ignore[index]
            return loss

        result = ddpkit.fit(s, model, opt, loader, train_step, max_steps=steps, progress=False)
        anatomy = result.anatomy
        return {
            "rank": s.rank,
            "history": anatomy["history"],
            "table": anatomy["ranks"],
            "hosts": anatomy["hosts"],
            "findings": [f.message() for f in anatomy["findings"]],
        }


def plot(ranks: list[dict[str, Any]], path: str, title: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        len(ranks), 1, figsize=(12, 1.8 + 1.6 * len(ranks)), sharex=True, sharey=True, squeeze=False
    )
    for ax, r in zip(axes[:, 0], ranks, strict=True):
        history = r["history"]
        x = range(1, len(history) + 1)
        bottom = [0.0] * len(history)
        for i, phase in enumerate(PHASES):
            heights = [row[i] * 1e3 for row in history]
            ax.bar(x, heights, bottom=bottom, width=1.0, color=COLOURS[phase], label=phase, linewidth=0)
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        ax.set_ylabel(f"rank {r['rank']}\nms per step")
    axes[0, 0].legend(loc="upper right", ncol=len(PHASES), fontsize="small")
    axes[-1, 0].set_xlabel("optimizer step (the last ones fit kept)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main_ranks(workload: str, nproc: int, steps: int, slow_spec: str | None, out: str) -> int:
    """The `--ranks` view: run, draw, print each rank's medians and fit's slow-rank report."""
    import ddpkit

    slow = parse_slow(slow_spec)
    ranks = ddpkit.spawn(rank_main, nproc=nproc, args=(workload, steps, slow), threads=1, timeout=600)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "ranks_anatomy.json"), "w") as f:
        json.dump(ranks, f)
    planted = f", planted {slow_spec}" if slow else ""
    png = plot(ranks, os.path.join(out, "ranks.png"), f"{workload}: {nproc} ranks, {steps} steps{planted}")
    for r in ranks:
        history = r["history"]
        medians = {p: statistics.median(row[i] for row in history) * 1e3 for i, p in enumerate(PHASES)}
        text = ", ".join(f"{p} {v:.1f}" for p, v in medians.items())
        print(f"rank {r['rank']} on {r['hosts'][r['rank']]}: median ms per step: {text}")
    for message in ranks[0]["findings"] or ["no slow rank named"]:
        print(message)
    print(f"plot: {png}")
    return 0
