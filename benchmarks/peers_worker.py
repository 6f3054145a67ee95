"""One training loop, written the idiomatic way with each tool; used by benchmarks/peers.py.

Variants: `single` (one process, no DDP), `ddp` (hand-written DDP, torch's defaults), `ddpkit` (ddpkit's
defaults), `ddpkit-plain` (the README's plain loop: `loss.backward(); opt.step()`), `ddpkit-shm` (ddpkit
with the "shm" communication hook), `accelerate` (Hugging Face Accelerate, `Accelerator(cpu=True)` +
`prepare`), `fabric` (Lightning Fabric, strategy "ddp" on CPU).
Only the set-up differs; the step is the same everywhere, each tool's own backward and step:

    out = model(x); loss = criterion(out, y); opt.zero_grad(); backward(loss); opt.step()
    (ddpkit: s.backward(loss); s.step(opt), which shards the optimizer step over the ranks on CPU)

Run as a script by each tool's own launcher (cold start: time to the first finished step, peak memory):

    torchrun --standalone --nproc-per-node 2 benchmarks/peers_worker.py --variant ddp --workload cnn
    ddpkit run --nproc 2 benchmarks/peers_worker.py --variant ddpkit --workload cnn
    fabric run --accelerator cpu --strategy ddp --devices 2 benchmarks/peers_worker.py --variant fabric
    accelerate launch --cpu --num_processes 2 ... (starts ONE process: peers.py uses torchrun for it)

Each rank writes `<--out>/rank<r>.json` (or prints a line `PEERS {json}`) with its rank, world size,
threads, the wall time at which its first step finished, its step times and its peak resident memory
(ru_maxrss).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

STARTED = time.time()  # the script's first lines: launcher cost = this minus the command's start

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402

from ddpkit.tools import workloads  # noqa: E402

IMPORTED = time.time()  # torch and the benchmark's own imports (each tool imports its own in make())

FIRST_STEP_MARK = "PEERS_FIRST_STEP_DONE"
MARKS: dict[str, float] = {}  # wall times inside the set-up (ddp, ddpkit): group joined, model built, wrapped
VARIANTS = ("single", "ddp", "ddpkit", "ddpkit-plain", "ddpkit-shm", "accelerate", "fabric")


@dataclass
class Loop:
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    batches: Iterator[Any]
    backward: Callable[[torch.Tensor], None]
    world: int
    close: Callable[[], None] = lambda: None
    update: Callable[[], Any] | None = None  # the optimizer step as the tool writes it (default opt.step)


def _forever(loader: Any, sampler: Any = None) -> Iterator[Any]:
    epoch = 0
    while True:
        if sampler is not None:
            sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def make(variant: str, wl: workloads.Workload, data: Any, shard_optimizer: bool | str = "auto") -> Loop:
    torch.manual_seed(0)
    if variant == "single":
        model = wl.build()
        loader = DataLoader(data, batch_size=wl.global_batch, shuffle=True)
        return Loop(model, wl.optimizer(model.parameters()), _forever(loader), torch.Tensor.backward, 1)
    if variant == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        MARKS["group"] = time.time()
        net = wl.build()
        MARKS["build"] = time.time()
        model = DDP(net)
        MARKS["model"] = time.time()
        sampler = DistributedSampler(data, shuffle=True, seed=0)
        loader = DataLoader(data, batch_size=wl.global_batch // dist.get_world_size(), sampler=sampler)
        return Loop(
            model,
            wl.optimizer(model.parameters()),
            _forever(loader, sampler),
            torch.Tensor.backward,
            dist.get_world_size(),
        )
    if variant in ("ddpkit", "ddpkit-plain", "ddpkit-shm"):
        import ddpkit

        stack = contextlib.ExitStack()
        s = stack.enter_context(ddpkit.session(seed=0, verbose=False, shard_optimizer=shard_optimizer))
        MARKS["group"] = time.time()
        net = wl.build()
        MARKS["build"] = time.time()
        model = s.model(net, comm_hook="shm" if variant == "ddpkit-shm" else None)
        MARKS["model"] = time.time()
        loader = s.loader(data, batch_size=wl.global_batch, shuffle=True)
        opt = wl.optimizer(model.parameters())
        if variant == "ddpkit-plain":  # the README's first loop: loss.backward(); opt.step()
            return Loop(model, opt, _forever(loader), torch.Tensor.backward, s.world_size, stack.close)
        return Loop(
            model, opt, _forever(loader), s.backward, s.world_size, stack.close, update=lambda: s.step(opt)
        )  # ddpkit's step: sharded over the ranks on CPU
    if variant == "accelerate":
        from accelerate import Accelerator

        acc = Accelerator(cpu=True)
        model = wl.build()
        opt = wl.optimizer(model.parameters())
        loader = DataLoader(data, batch_size=wl.global_batch // acc.num_processes, shuffle=True)
        model, opt, loader = acc.prepare(model, opt, loader)
        return Loop(model, opt, _forever(loader), acc.backward, acc.num_processes, acc.free_memory)
    if variant == "fabric":
        from lightning.fabric import Fabric

        world = int(os.environ.get("WORLD_SIZE", "1"))
        fabric = Fabric(accelerator="cpu", strategy="ddp", devices=world)
        if os.environ.get("LT_CLI_USED") != "1":  # under `fabric run` the CLI has launched already
            fabric.launch()
        model = wl.build()
        model, opt = fabric.setup(model, wl.optimizer(model.parameters()))
        loader = fabric.setup_dataloaders(DataLoader(data, batch_size=wl.global_batch // world, shuffle=True))
        return Loop(model, opt, _forever(loader), fabric.backward, fabric.world_size)
    raise ValueError(f"unknown variant {variant!r}; choose from {VARIANTS}")


def step(wl: workloads.Workload, loop: Loop) -> None:
    x, y = next(loop.batches)
    out = loop.model(x)
    loss = wl.loss(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    loop.opt.zero_grad()
    loop.backward(loss)
    (loop.update or loop.opt.step)()


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kilobytes on Linux


def huge_pages_mb() -> float | None:
    """Anonymous memory backed by transparent huge pages now (Linux), to explain peak RSS."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--variant", choices=VARIANTS, required=True)
    p.add_argument("--workload", default="cnn")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", default=None, help="folder for rank<r>.json (default: print a PEERS line)")
    p.add_argument("--shard-optimizer", default="auto", help='"auto" or "gradients"')
    ns = p.parse_args()
    wl = workloads.load(ns.workload)
    data = wl.dataset(batches=4)
    made_at = time.time()
    loop = make(ns.variant, wl, data, ns.shard_optimizer)
    set_up = time.time()
    times, first_done = [], 0.0
    for i in range(ns.steps):
        start = time.perf_counter()
        step(wl, loop)
        times.append(time.perf_counter() - start)
        if i == 0:
            first_done = time.time()
            if not dist.is_initialized() or dist.get_rank() == 0:
                print(FIRST_STEP_MARK, flush=True)  # seen by the launching process as it happens
    rank = dist.get_rank() if dist.is_initialized() else 0
    report = {
        "rank": rank,
        "world": loop.world,
        "threads": torch.get_num_threads(),
        "first_step_done": first_done,
        "step_s": times,
        "phases": {"started": STARTED, "imported": IMPORTED, "data": made_at, "set_up": set_up, **MARKS},
        "peak_rss_mb": peak_rss_mb(),
        "huge_pages_mb": huge_pages_mb(),
    }
    if ns.out:  # a file per rank: lines printed by several ranks into one pipe can interleave
        with open(os.path.join(ns.out, f"rank{rank}.json"), "w") as f:
            json.dump(report, f)
    else:
        print("PEERS " + json.dumps(report), flush=True)
    loop.close()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
