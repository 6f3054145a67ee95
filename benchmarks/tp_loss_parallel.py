"""Loss parallel against a head that gathers its logits, TP(2) on CPU ranks: each rank's peak memory over
a training step and ms per step, the same model and batch.

    .venv/bin/python benchmarks/tp_loss_parallel.py                  # vocabulary 32768, 2 x 512 tokens
    .venv/bin/python benchmarks/tp_loss_parallel.py --vocab 65536 --steps 5 --json runs/tp_loss.json

A language-model head (embedding 256 wide, one Linear 256->256, head 256->vocabulary, fp32): at 1,024
tokens and a vocabulary of 32,768 the whole logits are 128 MiB. The head "colwise_gather_output" gives
every rank the whole logits (gathered), then the whole log-softmax and its gradient;
`TPOptions(loss_parallel=True)` keeps them sharded (half each) and runs the cross entropy inside torch's
`loss_parallel()`. Each mode runs in fresh processes (2 gloo ranks x 1 thread, torch.multiprocessing),
so the peak is the rank's resident set growth over the run (`ru_maxrss`, a high-water mark that only
rises: what the step added on top of the built model); the time is the median of `--steps` steps after
one warm-up step, with the (min, max). The load average is noted before and after.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ddpkit
from ddpkit.strategy.tp_options import TPOptions

D = 256
PLAN = {"head": "colwise_gather_output"}  # the head alone split: what loss parallel changes


class LM(nn.Module):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, D)
        self.mid = nn.Linear(D, D)
        self.head = nn.Linear(D, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> Any:
        return self.head(torch.tanh(self.mid(self.embed(ids))))


def _rank(rank: int, args: argparse.Namespace, parallel: bool, port: int, out: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    from torch.distributed.tensor.parallel import loss_parallel

    options = TPOptions(tensor=2, plan=PLAN, min_block_params=1, loss_parallel=parallel)
    with ddpkit.session(seed=0, verbose=False, strategy=options) as s:
        model = s.model(lambda: LM(args.vocab))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, args.vocab, (args.rows, args.seq), generator=g)
        y = torch.roll(x, -1, 1).flatten()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        times = []
        for _ in range(args.steps + 1):
            s.barrier()
            start = time.perf_counter()
            with loss_parallel() if parallel else contextlib.nullcontext():
                s.backward(F.cross_entropy(model(x).flatten(0, 1), y))
            s.step(opt)
            s.barrier()
            times.append((time.perf_counter() - start) * 1e3)
        grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024  # KiB on Linux
    out.put((rank, grown, times[1:]))


def run(args: argparse.Namespace, parallel: bool, port: int) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args, parallel, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    times = [t for _, _, ts in results for t in ts]
    return {
        "peak_mib": max(g for _, g, _ in results),
        "ms_median": statistics.median(times),
        "ms_min": min(times),
        "ms_max": max(times),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    load = [os.getloadavg()[0]]
    logits = args.rows * args.seq * args.vocab * 4 / 2**20
    rows = {}
    for i, (name, parallel) in enumerate((("gathered", False), ("loss parallel", True))):
        rows[name] = run(args, parallel, 29611 + i)
    load.append(os.getloadavg()[0])
    print(
        f"TP(2), 2 gloo ranks x 1 thread; whole logits {logits:.0f} MiB fp32; "
        f"load {load[0]:.1f} -> {load[1]:.1f}"
    )
    print("| head | peak growth per rank (MiB) | ms per step, median (min-max) |")
    print("|---|---|---|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['peak_mib']:.0f} | {r['ms_median']:.0f} ({r['ms_min']:.0f}-{r['ms_max']:.0f}) |"
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "load": load, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
