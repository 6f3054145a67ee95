"""`ddpkit bench collectives`: what the process group can move, against what memory can.

    ddpkit bench collectives                          # 2 ranks, 4 KB .. 256 MB
    ddpkit bench collectives --nproc 2,4 --max-size 64MB --out runs/coll

For each operation and size S (bytes of the full buffer, as nccl-tests count it) the table gives the
median time, the algorithm bandwidth algbw = S / t and the bus bandwidth busbw = algbw x factor, the
rate each link must sustain, comparable across world sizes n (nccl-tests' PERFORMANCE.md):

| operation      | S is                    | busbw factor |
|----------------|-------------------------|--------------|
| all_reduce     | the buffer              | 2(n-1)/n     |
| all_gather     | the output (n inputs)   | (n-1)/n      |
| reduce_scatter | the input (n outputs)   | (n-1)/n      |
| broadcast      | the buffer              | 1            |

`all_reduce[shm]` is ddpkit's shared-memory all-reduce (ddpkit.parallel.shm_allreduce, the "shm" hook: mean,
same machine). The ceiling is one process copying S bytes (torch `copy_`, same thread count as a rank).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from ddpkit.bench import report
from ddpkit.errors import problem
from ddpkit.tools.plotting import pyplot

OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_reduce[shm]")
FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_reduce[shm]": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}


def parse_size(text: str) -> int:
    units = {"KB": 2**10, "MB": 2**20, "GB": 2**30, "K": 2**10, "M": 2**20, "G": 2**30, "B": 1}
    t = text.strip().upper()
    for unit, mult in units.items():
        if t.endswith(unit) and t[: -len(unit)].replace(".", "").isdigit():
            return int(float(t[: -len(unit)]) * mult)
    if t.isdigit():
        return int(t)
    raise ValueError(f"cannot read size {text!r}: use e.g. 4KB, 16MB, 1GB")


def sizes_between(lo: int, hi: int) -> list[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= 4
    return out


def _iters(size: int) -> int:
    return int(min(50, max(3, (64 << 20) // size)))


def _time_ops(ops: list[str], sizes: list[int], rounds: int) -> dict[str, Any]:
    """Rank body: per (op, size), `rounds` timed loops interleaved; rank 0's per-op seconds."""
    import torch
    import torch.distributed as dist

    import ddpkit

    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch < 2.13
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    with ddpkit.session(verbose=False) as s:
        n = s.world_size
        shm = ddpkit.ShmAllReduce(chunk_mb=16) if "all_reduce[shm]" in ops else None
        times: dict[str, list[float]] = {f"{op}/{size}": [] for op in ops for size in sizes}
        for _ in range(rounds):
            for size in sizes:
                full = torch.ones(size // 4)
                part = torch.ones(size // 4 // n)
                run = {
                    "all_reduce": lambda full=full: dist.all_reduce(full),
                    "broadcast": lambda full=full: dist.broadcast(full, src=0),
                    "all_gather": lambda full=full, part=part: all_gather(full, part),  # type: ignore[misc]
                    "reduce_scatter": lambda full=full, part=part: reduce_scatter(part, full),  # type: ignore[misc]
                    "all_reduce[shm]": lambda full=full: shm.all_reduce_mean_(full),  # type: ignore[union-attr]
                }
                for op in ops:
                    run[op]()  # warm-up: first touch of pages, connections
                    dist.barrier()
                    start = time.perf_counter()
                    for _ in range(_iters(size)):
                        run[op]()
                    times[f"{op}/{size}"].append((time.perf_counter() - start) / _iters(size))
        reason = shm.reason if shm else ""
        if shm:
            shm.close()
    return {"times": times, "shm": reason}


def world_sizes(text: str) -> list[int]:
    """`--nproc 2,4` -> [2, 4]. One rank is refused: every operation here moves bytes between ranks, and
    alone a rank has none to move (torch's collectives on a world of one return at once, and the shm
    all-reduce maps nothing), so its figures would time Python, not the process group."""
    try:
        counts = [int(n) for n in text.split(",") if n.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 2:
        raise problem(
            f"--nproc {text}: a collective moves bytes between ranks, and one rank has none to move",
            "Pass 2 or more ranks (e.g. --nproc 2, or --nproc 2,4); the memcpy ceiling of one process "
            "is printed beside every world size",
        )
    return counts


def memcpy_seconds(size: int, threads: int, rounds: int = 3) -> float:
    import torch

    torch.set_num_threads(threads)
    a, b = torch.ones(size // 4), torch.empty(size // 4)
    b.copy_(a)
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(_iters(size)):
            b.copy_(a)
        samples.append((time.perf_counter() - start) / _iters(size))
    return statistics.median(samples)


def run(ns: argparse.Namespace) -> int:
    import ddpkit

    sizes = sizes_between(parse_size(ns.min_size), parse_size(ns.max_size))
    ops = [o for o in ns.ops.split(",") if o]
    unknown = set(ops) - set(OPS)
    if unknown:
        print(f"ddpkit bench collectives: error: unknown op(s) {sorted(unknown)}; choose from {OPS}")
        return 2
    counts = world_sizes(ns.nproc)
    cores = report.machine()["cores"]
    before, steal0 = report.machine()["load_average"], report.cpu_steal()
    results: dict[str, Any] = {"machine": report.machine(), "sizes": sizes, "worlds": {}}
    memcpy = {size: memcpy_seconds(size, ns.threads) for size in sizes}
    results["memcpy_GBps"] = {size: size / t / 1e9 for size, t in memcpy.items()}
    for n in counts:
        print(
            f"ddpkit bench collectives: {n} ranks x {ns.threads} thread(s), {len(ops)} ops, "
            f"{len(sizes)} sizes, {ns.rounds} rounds",
            flush=True,
        )
        out = ddpkit.spawn(
            _time_ops, nproc=n, args=(ops, sizes, ns.rounds), threads=ns.threads, timeout=ns.timeout
        )[0]
        if out["shm"]:
            print(f"  all_reduce[shm]: {out['shm']}")
        rows, table_rows = [], []
        for size in sizes:
            row: list[Any] = [_human(size)]
            for op in ops:
                t = statistics.median(out["times"][f"{op}/{size}"])
                algbw = size / t / 1e9
                busbw = algbw * FACTORS[op](n)
                rows.append(
                    {
                        "op": op,
                        "bytes": size,
                        "seconds": t,
                        "algbw_GBps": algbw,
                        "busbw_GBps": busbw,
                        "spread": _spread(out["times"][f"{op}/{size}"]),
                    }
                )
                row += [t * 1e6, busbw]
            table_rows.append([*row, results["memcpy_GBps"][size]])
        results["worlds"][str(n)] = rows
        headers = ["size"] + [h for op in ops for h in (f"{op} us", "busbw")] + ["memcpy GB/s"]
        print(report.table(headers, table_rows))
        print("(busbw in GB/s; algbw = busbw / factor, in the JSON; medians over rounds)")
    after, steal1 = report.machine()["load_average"], report.cpu_steal()
    results.update(load_before=before, load_after=after)
    note = report.load_note(before, after, cores, (steal0, steal1))
    if note:
        print(note)
    os.makedirs(ns.out, exist_ok=True)
    print(f"json: {report.write_json(os.path.join(ns.out, 'collectives.json'), results)}")
    print(f"plot: {plot(results, ops, os.path.join(ns.out, 'collectives.png'))}")
    return 0


def _spread(samples: list[float]) -> float:
    return (max(samples) - min(samples)) / statistics.median(samples)


def _human(size: int) -> str:
    for unit, mult in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if size >= mult:
            return f"{size / mult:g} {unit}"
    return f"{size} B"


def plot(results: dict[str, Any], ops: list[str], path: str) -> str:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    sizes = results["sizes"]
    for n, rows in results["worlds"].items():
        for op in ops:
            pts = [r["busbw_GBps"] for r in rows if r["op"] == op]
            ax.plot(sizes, pts, "o-", ms=3, label=f"{op}, {n} ranks")
    ax.plot(sizes, [results["memcpy_GBps"][s] for s in sizes], "k--", label="memcpy, 1 process (ceiling)")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="bytes",
        ylabel="bus bandwidth, GB/s",
        title="collectives on this machine (nccl-tests busbw)",
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", default="2", help="world sizes, comma-separated (e.g. 2,4)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per rank")
    p.add_argument("--min-size", default="4KB")
    p.add_argument("--max-size", default="256MB")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {','.join(OPS)}")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before the ranks are stopped")
    p.add_argument("--out", default="runs/bench-collectives", help="folder for collectives.json and .png")
