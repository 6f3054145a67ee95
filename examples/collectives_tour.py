"""A tour of the collective primitives DDP is built on, each rank's result checked against the expected one.

    python examples/collectives_tour.py            # starts 2 gloo ranks (pass a number for more: ... 3)
    ddpkit run --nproc 3 examples/collectives_tour.py

rank and world size, barrier, send/recv (a ring), broadcast, all_reduce, gather, scatter, all_gather.
Every rank computes what it holds after each call and what it should hold (`expected`); `tour` returns
both so that a test, or this script, can compare them.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import ddpkit


def expected(rank: int, world: int) -> dict[str, list[float]]:
    """What rank `rank` of `world` must hold after each step of the tour."""
    return {
        "rank_world": [rank, world],
        "barrier": [1.0],
        "recv_from_left": [
            float((rank - 1) % world) * 10
        ],  # the ring: each rank sends 10 * rank to the right
        "broadcast": [1.0, 2.0, 3.0],  # rank 0's tensor, everywhere
        "all_reduce_sum": [float(sum(range(1, world + 1)))],  # 1 + 2 + ... + world
        "all_reduce_max": [float(world - 1)],
        "gather": [float(r * r) for r in range(world)] if rank == 0 else [],  # only the destination gets it
        "scatter": [float(rank), float(rank) + 0.5],  # rank 0 cut its tensor in world pieces
        "all_gather": [float(r + 100) for r in range(world)],
    }


def tour() -> dict[str, dict[str, list[float]]]:
    """Run every primitive once on this rank; return {"got": ..., "expected": ...}."""
    with ddpkit.session(verbose=False) as s:
        rank, world = dist.get_rank(), dist.get_world_size()
        got: dict[str, list[float]] = {"rank_world": [rank, world]}

        dist.barrier()  # nobody passes until everybody has arrived
        got["barrier"] = [1.0]

        # Point to point, as a ring. Post the receive first (irecv does not block), then send: a ring
        # of blocking sends would wait forever for receivers that are themselves sending.
        inbox = torch.zeros(1)
        pending = dist.irecv(inbox, src=(rank - 1) % world)
        dist.send(torch.tensor([rank * 10.0]), dst=(rank + 1) % world)
        pending.wait()
        got["recv_from_left"] = inbox.tolist()

        t = torch.tensor([1.0, 2.0, 3.0]) if rank == 0 else torch.zeros(3)
        dist.broadcast(t, src=0)  # what DDP does once at wrap time, for every parameter and buffer
        got["broadcast"] = t.tolist()

        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t, op=dist.ReduceOp.SUM)  # what DDP does to each gradient bucket in backward
        got["all_reduce_sum"] = t.tolist()
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        got["all_reduce_max"] = t.tolist()

        mine = torch.tensor([float(rank * rank)])
        bucket = [torch.zeros(1) for _ in range(world)] if rank == 0 else None
        dist.gather(mine, gather_list=bucket, dst=0)
        got["gather"] = torch.cat(bucket).tolist() if bucket else []

        pieces = [torch.tensor([float(r), r + 0.5]) for r in range(world)] if rank == 0 else None
        piece = torch.zeros(2)
        dist.scatter(piece, scatter_list=pieces, src=0)
        got["scatter"] = piece.tolist()

        everyone = [torch.zeros(1) for _ in range(world)]
        dist.all_gather(everyone, torch.tensor([rank + 100.0]))
        got["all_gather"] = torch.cat(everyone).tolist()

        s.barrier()
        return {"got": got, "expected": expected(rank, world)}


def main() -> None:
    if "RANK" in os.environ:  # started by a launcher: this process is one rank
        results = [tour()]
    else:
        results = ddpkit.spawn(tour, nproc=int(sys.argv[1]) if len(sys.argv) > 1 else 2)
    for result in results:
        rank = result["got"]["rank_world"][0]
        for name, value in result["got"].items():
            mark = (
                "ok" if value == result["expected"][name] else f"WRONG, expected {result['expected'][name]}"
            )
            print(f"rank {rank} {name:>15}: {value} {mark}", flush=True)


if __name__ == "__main__":
    main()
