"""Tensor parallelism against FSDP and DDP on CPU ranks: ms per training step, the same global batch.

    .venv/bin/python benchmarks/tp_vs_fsdp.py                       # 2 ranks x 1 thread, batches 64 and 2048
    .venv/bin/python benchmarks/tp_vs_fsdp.py --rounds 5 --json runs/tp_vs_fsdp.json
    .venv/bin/python benchmarks/tp_vs_fsdp.py --batches 64 --rounds 5 --names tp,torch-tp,half,local,ddp

`--names` adds plain models timed the same way, without ddpkit's session, to take TP's step apart (the
validation of `ddpkit plan --strategy tp`, docs/planning.md): "local" the whole model on the whole
batch on each rank (what the plan profiles, the ranks computing at once), "half" one tensor rank's
share of it (the hidden width halved: does the compute divide by T?), "torch-tp" torch's
`parallelize_module` alone on a 1-D mesh (DTensor and the activations' all-reduces, without ddpkit's
FSDP2 over the data mesh and its dropout dispatch mode). `--nproc 1 --names local,torch-tp` times
torch's TP on a one-rank mesh against the plain model: the same matmuls, no communication, so the
difference is DTensor's own host time per step.

A stack of 4 x (Linear 512->2048, GELU, Linear 2048->512) with residuals: 32 MiB of fp32 weights. TP(2)
splits each pair (up column-wise, down row-wise: one all-reduce of the activations per block in forward
and one in backward) and every rank runs the whole batch; FSDP(2) (ddpkit's, shared-memory collectives)
and DDP(2) run half the batch each on the whole model. Each round opens one session per strategy (the
process group stays), in an order that rotates every round, and times `--steps` steps after one
warm-up step (`s.backward; s.step`, SGD, barriers around each step); the figure is the median over
rounds of each round's median, the spread the rounds' (min, max). The load average is noted before and
after: the machine's other work moves these figures by 2x between minutes.

The honest verdict to expect on gloo: TP wins only where the weights are large against the
activations (a small batch: it moves ~1 MiB of activations per step where FSDP all-gathers the weights
twice and reduce-scatters them once); at a large batch its all-reduces of activations grow with the
batch and it falls level with FSDP and behind DDP. TP's value is on NVLink, inside a node.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ddpkit
from ddpkit.strategy.tp_options import TPOptions

D, HIDDEN, BLOCKS = 512, 2048, 4
PLAN = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}


class Pair(nn.Module):
    def __init__(self, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.up = nn.Linear(D, hidden)
        self.down = nn.Linear(hidden, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Pair() for _ in range(BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class HalfStack(Stack):
    """One tensor rank's share of `Stack` as a plain model: the hidden width halved (what TP(2) computes)."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.blocks = nn.ModuleList(Pair(HIDDEN // 2) for _ in range(BLOCKS))


def torch_tp(world: int) -> nn.Module:
    """torch's tensor parallelism alone (`parallelize_module` on a 1-D mesh, no FSDP2, no dispatch mode)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    styles = {
        f"blocks.{i}.{k}": (ColwiseParallel() if k == "up" else RowwiseParallel())
        for i in range(BLOCKS)
        for k in ("up", "down")
    }
    return parallelize_module(Stack(), mesh, styles)


def strategy(name: str) -> object:
    if name == "tp":
        return TPOptions(tensor=2, plan=PLAN, min_block_params=1)
    return name


def timed(name: str, batch: int, steps: int) -> list[float]:
    """One session of `name`: a warm-up step, then `steps` timed ones (rank 0's seconds)."""
    import torch.distributed as dist

    x = torch.randn(batch, D, generator=torch.Generator().manual_seed(1))
    if name in LOCAL:  # no session: each rank alone, every rank computing at once (the plan's profile)
        torch.manual_seed(0)
        model = torch_tp(dist.get_world_size()) if name == "torch-tp" else LOCAL[name]()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        return _steps(
            model, opt, x, steps, lambda loss: loss.backward(), lambda: (opt.step(), opt.zero_grad())
        )
    chosen = strategy(name)
    with ddpkit.session(seed=0, verbose=False, strategy=chosen) as s:
        model = s.model(Stack, strategy=chosen if name == "tp" else None)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        mine = x if name == "tp" else x.chunk(s.world_size)[s.rank]  # TP: the tensor group's one batch
        return _steps(model, opt, mine, steps, s.backward, lambda: s.step(opt))


def _steps(model: nn.Module, opt: Any, x: torch.Tensor, steps: int, backward: Any, step: Any) -> list[float]:
    import torch.distributed as dist

    times = []
    for i in range(steps + 1):
        dist.barrier()
        start = time.perf_counter()
        backward(model(x).square().mean())
        step()
        dist.barrier()
        if i:
            times.append(time.perf_counter() - start)
    return times


# plain models timed beside the strategies: "local" the whole model on the whole batch (what `ddpkit plan`
# profiles, n ranks at once), "half" one tensor rank's share of it, "torch-tp" torch's TP without ddpkit's
LOCAL: dict[str, Any] = {"local": Stack, "half": HalfStack, "torch-tp": None}


def rank_main(batches: list[int], rounds: int, steps: int, names: list[str]) -> dict[str, Any]:
    import torch.distributed as dist

    if not dist.is_initialized():  # one group for every session of the rank (each leaves it alone)
        dist.init_process_group("gloo")
    medians: dict[str, dict[str, list[float]]] = {str(b): {n: [] for n in names} for b in batches}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for batch in batches:
            for name in order:
                medians[str(batch)][name].append(statistics.median(timed(name, batch, steps)) * 1e3)
    return medians


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batches", default="64,2048")
    p.add_argument("--json", default=None)
    p.add_argument(
        "--nproc", type=int, default=2, help="ranks (1: --names local,torch-tp, DTensor's own cost)"
    )
    p.add_argument("--names", default="tp,fsdp,ddp", help="tp,fsdp,ddp and the plain local,half,torch-tp")
    ns = p.parse_args()
    batches = [int(b) for b in ns.batches.split(",")]
    load_before = os.getloadavg()
    result = ddpkit.spawn(
        rank_main, 2, args=(batches, ns.rounds, ns.steps, ns.names.split(",")), threads=1, timeout=900
    )[0]
    load_after = os.getloadavg()
    rows = {}
    for batch, by_name in result.items():
        rows[batch] = {
            n: {
                "median_ms": round(statistics.median(v), 1),
                "spread_ms": [round(min(v), 1), round(max(v), 1)],
            }
            for n, v in by_name.items()
        }
    out = {
        "model": f"{BLOCKS} x (Linear {D}->{HIDDEN}, GELU, Linear {HIDDEN}->{D}), 32 MiB fp32, SGD",
        "ranks": f"{ns.nproc} gloo CPU rank(s) x 1 thread",
        "rounds": ns.rounds,
        "steps": ns.steps,
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in load_after],
        "torch": torch.__version__,
        "ms_per_step": rows,
    }
    print(json.dumps(out, indent=1))
    for batch, by_name in rows.items():
        line = ", ".join(
            f"{n.upper()}({ns.nproc}) {v['median_ms']} ms ({v['spread_ms'][0]}-{v['spread_ms'][1]})"
            for n, v in by_name.items()
        )
        print(f"global batch {batch}: {line}")
    if ns.json:
        Path(ns.json).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
