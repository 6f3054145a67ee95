"""Memory snapshots across hosts: the keepers meet through the job's store, each copies to its buddy,
and a recovery that cannot come from memory says why in one line.

    peers = meet(ctx, snaps.wire)   # collective, at s.load(..., memory=N): wires this host's buddy
    snaps.fetch_from(peers)       # a replacement host's ranks: their slots from the buddy's keeper
    note = why_disk(snaps.rows, world)   # after the agreement found no step every rank holds

`ddpkit run` across hosts starts each host's keeper with a TCP port and a job token of its own
(`ddpkit.cluster.keeper`: ADDRESS_ENV, TOKEN_ENV in every rank's environment). At the load every rank
publishes its keeper's address and token in the job's store (the rendezvous's c10d store of this
round, the one the ranks already share) and reads every other rank's. The hosts in node order (the
order of their lowest global rank, which is torchrun's node order) form a ring: each host's keeper
copies its ranks' snapshots to the next host's, its buddy. A host lost whole takes its keeper's memory
with it, but its ranks' snapshots are on its buddy: its replacement's ranks (an empty keeper) fetch
them from there, buddy first, then the other hosts' keepers (after a change of node order a host's
copies may sit on another). A single host (or no TCP) wires nothing.

The store is no more trusted than the network it runs on: the token keeps another job's ranks (or a
stray client) from reading or overwriting this job's snapshots, not an attacker who can read the
job's own store.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ddpkit.checkpoint import state as checkpoint_state
from ddpkit.checkpoint.sync import CheckpointContext, Sync
from ddpkit.cluster.keeper import ADDRESS_ENV, TOKEN_ENV
from ddpkit.data import ShardedLoader

__all__ = ["meet", "resize_refusal", "ring", "why_disk"]


def ring(seen: Sequence[tuple[str, str]], mine: tuple[str, str]) -> list[tuple[str, str]]:
    """The other hosts' keepers from `seen` (every rank's (address, token), by global rank), the buddy
    (the next host in node order) first; [] for one host or none with an address."""
    hosts = list(dict.fromkeys(k for k in seen if k[0]))
    if mine not in hosts or len(hosts) < 2:
        return []
    i = hosts.index(mine)
    return [hosts[(i + k) % len(hosts)] for k in range(1, len(hosts))]


def meet(ctx: CheckpointContext, wire: Callable[[str, str], None]) -> list[tuple[str, str]]:
    """Collective (every rank, through the store): this host's keeper wired to its buddy's (`wire`:
    `MemorySnapshots.wire`); returns the other hosts' keepers, buddy first, for a rank whose own keeper
    lacks its slots."""
    if ctx.group is None:
        return []
    mine = (os.environ.get(ADDRESS_ENV, ""), os.environ.get(TOKEN_ENV, ""))
    sync = Sync(ctx, "memory")
    sync.publish(f"keeper/{ctx.rank}", " ".join(mine))
    seen = []
    for r in range(ctx.world_size):
        address, _, token = sync.wait_one(r, f"keeper/{r}", "the hosts' snapshot keepers").partition(" ")
        seen.append((address, token))
    peers = ring(seen, mine)
    if peers:
        wire(*peers[0])
    return peers


def why_disk(rows: Sequence[Sequence[int]], world: int) -> str:
    """The one line that says why no snapshot is restored, from every rank's row of the agreement (its two
    steps, the disk's step, whether its slots came from another host, another world size its keeper
    holds); "" for a fresh start (nothing held anywhere)."""
    held = {r: [s for s in row[:2] if s >= 0] for r, row in enumerate(rows)}
    if not any(held.values()):
        other = max((row[4] for row in rows), default=-1)
        if other > 0:
            return (
                f"ddpkit: the memory snapshots on this job's hosts are of world size {other} and this run "
                f"has {world} ranks (an elastic resize): a snapshot restores only at the world size that "
                "took it (each rank's RNG streams and loader position are its own), so recovery is from disk"
            )
        return ""
    shown = "; ".join(
        f"rank {r}: {', '.join(map(str, steps)) or 'none'}{' (from another host)' if rows[r][3] else ''}"
        for r, steps in list(held.items())[:8]
    )
    cause = (
        "the copy of a lost host's snapshots on its buddy was behind the others"
        if any(row[3] for row in rows)
        else "a rank lacks the others' steps (a host lost, or a snapshot in flight)"
    )
    return f"ddpkit: no step is held in memory by every rank ({shown}): {cause}, so recovery is from disk"


def resize_refusal(strategy: Any, state: Mapping[str, Any]) -> str:
    """Why snapshots taken at a larger world size cannot be restored into `state` here ("" when they
    can). After an elastic shrink, new rank r takes old rank r's snapshot, as a disk checkpoint's own
    rank files are taken: under DDP (or one process) every rank's snapshot holds the whole model and
    optimizer, the loader re-splits its position and the surviving ranks' RNG streams are their own.
    Under FSDP and HSDP a snapshot holds one rank's shards at the old world size; an object kept per
    rank (other than ddpkit's loader and a generator) has no state known to belong to each new rank."""
    if getattr(strategy, "shards_state", False):
        return "under FSDP and HSDP each rank's snapshot holds its shards at that world size"
    for name, obj in checkpoint_state.split(state)["per_rank"].items():
        if not isinstance(obj, (ShardedLoader, torch.Generator)):
            return f"{name}= ({type(obj).__name__}) is kept per rank and no rank's state belongs to each rank"
    return ""
