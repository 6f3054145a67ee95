"""Memory snapshots: every rank's whole training state, every N optimizer steps, in memory its host's
keeper holds (`ddpkit.cluster.keeper`), so a killed rank costs one step, not a checkpoint interval.

    snaps = MemorySnapshots.attach(keeper_name, rank, world)   # this rank's two slots, if the keeper has any
    target = snaps.agree(distributed=True, device=device)      # collective: newest step every rank holds
    if target is not None:
        values = snaps.restore(target, strategy, state)        # state: what s.load takes, as keywords
    ...
    snaps.save(step, strategy, state)                           # at a step boundary, every N steps

A rank's snapshot lives in two slots (memfd segments; double buffering), each laid out as
    [header 64 B: magic, step, seq, tree offset, tree length, tree crc32][tensor bytes][tree JSON]
A save writes the slot that does not hold the newest complete step: its step := -1 first, then the
tensors, then the JSON tree (the objects' structure, each tensor's offset, dtype and shape, the small
values) and its crc32, then the step, last, as one aligned 8-byte store. A rank killed anywhere in
between leaves that slot marked incomplete and the other one whole; a torn tree fails its crc. No
fsync, no rename, no digest of the bytes on the training thread: the copy is the whole cost.

Every slot carries its own step, and `agree` restores only a step every rank holds whole (`choose`:
the newest in every rank's set), so a recovery never mixes two steps. `restore` compares the layout
(every tensor's path, dtype and shape) with the live objects' first: a snapshot of another model or
script is never loaded (`SnapshotMismatch`, then the disk path). What a snapshot holds is what a disk
checkpoint holds (`ddpkit.checkpoint.state.split`): the modules (under FSDP and HSDP the strategy's
sharded state, each rank its DTensor shards), the stateful objects (optimizer, scheduler), the
per-rank ones (loader position, generators), every RNG stream of the rank and the plain values.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import sys
import time
import zlib
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.checkpoint import dcp as checkpoint_dcp
from ddpkit.checkpoint import files
from ddpkit.checkpoint import state as checkpoint_state
from ddpkit.checkpoint.memory_cadence import Cadence, buddy_report
from ddpkit.checkpoint.memory_hosts import meet, resize_refusal, why_disk
from ddpkit.checkpoint.owners import StateOwner
from ddpkit.checkpoint.staging import Arena
from ddpkit.checkpoint.sync import CheckpointContext
from ddpkit.cluster.keeper import HEAD, MAGIC, STEP_AT, KeeperClient, KeeperRefused, fetch
from ddpkit.errors import DdpkitError, problem
from ddpkit.names import KEEPER_ENV
from ddpkit.parallel.modules import unwrap

HEADER = 64  # bytes before the first tensor (the header itself is HEAD.size)
ALIGN = 64
# The buddy copy's lag bound: how many of a rank's snapshots may be committed here and not yet held by the
# buddy host's keeper. A commit beyond it waits for the buddy (training waits) for at most BUDDY_WAIT
# seconds; past that, one line says so, training goes on and a host lost before the copy catches up
# recovers from disk (the recovery names it: no step every rank holds).
BUDDY_LAG = 1
BUDDY_WAIT = 30.0
# `s.load(..., buddy=)`: "behind" (the bound above), or "before-next-step": step k's copy acknowledged before
# step k+1's first forward (`MemorySnapshots.settle`), so a lost host recomputes at most the step in flight.
BUDDY_MODES = ("behind", "before-next-step")
__all__ = ["BUDDY_MODES", "MemoryRecovery", "MemorySnapshots", "SnapshotMismatch", "choose"]


class SnapshotMismatch(DdpkitError):
    """The snapshot in memory was taken of other objects (another model, optimizer or layout)."""


def choose(held: Sequence[Collection[int]]) -> int | None:
    """The newest step every rank holds a complete snapshot of, or None (recover from disk).

    `held[r]` is rank r's complete steps. One rank killed in the middle of a snapshot holds the step
    before while the others hold it and the one before: the newest common step is the one before."""
    if not held:
        return None
    common = set(held[0]).intersection(*held[1:])
    return max(common) if common else None


class Slot:
    """One memfd segment, mapped: a header and one snapshot."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.size = os.fstat(fd).st_size
        self.map = mmap.mmap(fd, self.size)
        self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)

    @classmethod
    def new(cls, size: int, name: str) -> Slot:
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        os.ftruncate(fd, -(-size // mmap.PAGESIZE) * mmap.PAGESIZE)
        return cls(fd)

    def header(self) -> tuple[int, int, int, int, int]:
        """(step, seq, tree offset, tree length, tree crc); step -1: no complete snapshot."""
        if self.size < HEADER:
            return -1, 0, 0, 0, 0
        magic, step, seq, off, n, crc = HEAD.unpack_from(self.map, 0)
        return (step, seq, off, n, crc) if magic == MAGIC else (-1, 0, 0, 0, 0)

    def complete_step(self) -> int:
        step, _, off, n, crc = self.header()
        if step < 0 or off + n > self.size or zlib.crc32(self.map[off : off + n]) != crc:
            return -1
        return step

    def begin(self, seq: int) -> None:
        """From here until `commit` this slot holds no snapshot."""
        HEAD.pack_into(self.map, 0, MAGIC, -1, seq, 0, 0, 0)

    def commit(self, step: int, seq: int, body: bytes, at: int) -> None:
        self.map[at : at + len(body)] = body
        HEAD.pack_into(self.map, 0, MAGIC, -1, seq, at, len(body), zlib.crc32(body))
        struct.pack_into("<q", self.map, STEP_AT, step)  # the commit: one aligned 8-byte store, last

    def view(self, offset: int, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        n = int(torch.Size(shape).numel()) * torch.empty(0, dtype=dtype).element_size()
        return self.bytes[offset : offset + n].view(dtype).view(tuple(shape))

    def close(self) -> None:
        del self.bytes
        self.map.close()
        os.close(self.fd)


# -- the state of one rank, as references to the live tensors -----------------------------------------
def capture(strategy: StateOwner, state: Mapping[str, Any]) -> dict[str, Any]:
    """The whole state of this rank now: references (no copy) to the live tensors (`_locals` turns its
    DTensors into their local shards). The same parts as a disk checkpoint (`checkpoint.state.split`)."""
    parts = checkpoint_state.split(state)
    sharded = checkpoint_dcp.split(strategy, parts)
    out: dict[str, Any] = {
        "rng": checkpoint_state.rng_state(),
        "values": dict(parts["values"]),
        "modules": {n: unwrap(m).state_dict() for n, m in parts["modules"].items()},
        "shared": {n: o.state_dict() for n, o in parts["shared"].items()},
        "per_rank": {
            n: o.get_state() if isinstance(o, torch.Generator) else o.state_dict()
            for n, o in parts["per_rank"].items()
        },
    }
    if sharded is not None:
        out["sharded"] = checkpoint_dcp.assemble(strategy, sharded)
    return out


def _locals(obj: Any) -> Any:
    """`obj` with every DTensor its local shard. Leaves are returned as they are, and a list or tuple of
    plain values (Python's RNG state: 625 ints) is not walked: this runs at every snapshot."""
    from torch.distributed.tensor import DTensor

    def walk(obj: Any) -> Any:
        if isinstance(obj, DTensor):
            return obj.to_local()
        if isinstance(obj, Mapping):
            return {k: walk(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)) and not all(isinstance(v, _PLAIN) for v in obj):
            return type(obj)(walk(v) for v in obj)
        return obj

    return walk(obj)


_PLAIN = (int, float, str, bool, type(None))


def _as_template(live: Any, saved: Any) -> Any:
    """`saved` (local shards) as DTensors wherever the live state holds one (its mesh and placements)."""
    from torch.distributed.tensor import DTensor

    if isinstance(live, DTensor) and isinstance(saved, torch.Tensor):
        return DTensor.from_local(
            saved, live.device_mesh, live.placements, shape=live.shape, stride=live.stride(), run_check=False
        )
    if isinstance(live, Mapping) and isinstance(saved, Mapping):
        return {k: _as_template(live.get(k), v) for k, v in saved.items()}
    return saved


def layout_of(tree_tensors: Mapping[str, torch.Tensor]) -> dict[str, list[Any]]:
    return {p: [str(t.dtype).removeprefix("torch."), list(t.shape)] for p, t in tree_tensors.items()}


# -- this rank's slots ---------------------------------------------------------------------------------
class MemorySnapshots:
    """This rank's two slots, held by its host's keeper (None: local only, e.g. in a unit test)."""

    def __init__(self, client: KeeperClient | None, key: str, fds: Sequence[int] = ()) -> None:
        self.client, self.key = client, key
        self.slots = [Slot(fd) for fd in fds]
        self.seq = max([s.header()[1] for s in self.slots] + [0])
        self.last_bytes = 0
        self.lost_keeper = False  # the keeper went away: these slots no longer outlive this process
        self.fetched = False  # these slots came from another host's keeper (a replacement host)
        self.resized_from = -1  # these slots were taken at this larger world size (an elastic shrink)
        self.rows: list[list[int]] = []  # every rank's row of the last agreement (`agree_with`)
        self.other_world = -1  # the largest other world size this host's keeper holds snapshots of
        self.lag, self.lag_wait = BUDDY_LAG, BUDDY_WAIT
        self.commits: list[int] = []  # steps committed here the buddy has not acknowledged yet
        self.buddy_behind = False  # the lag bound was passed and said: waiting stops until it catches up
        self.waited_s = 0.0  # time the training thread waited for the buddy copy
        self.strict = False  # buddy="before-next-step": every commit acknowledged before the next forward
        self.awaiting = False  # strict: a commit whose acknowledgement `settle` has not waited for yet
        self.waits: deque[float] = deque(maxlen=4096)  # the training thread's wait, per snapshot copied
        self.copies = 0  # snapshots handed to the buddy copy
        self.sent_bytes = 0  # their bytes (the keeper sends a slot's used bytes; superseded ones dropped)

    @classmethod
    def attach(
        cls, keeper: str | None, rank: int, world: int, peers: Sequence[tuple[str, str]] = ()
    ) -> MemorySnapshots:
        """This rank's slots from the keeper named `keeper` (none yet: a fresh start). A rank whose
        keeper lacks them (a replacement host) fetches them from another host's keeper (`peers`,
        (TCP HOST:PORT, its job token)) into new slots, which its own keeper holds from then on."""
        key = f"w{world}/r{rank}"
        client = KeeperClient.connect(keeper) if keeper else None
        self = cls(client, key, client.get(key) if client else ())
        if client is not None and not self.slots:
            worlds = [
                int(k.split("/")[0][1:]) for k in client.keys()["keys"] if k.split("/")[0] != f"w{world}"
            ]
            self.other_world = max(worlds, default=-1)
            if rank < self.other_world and world < self.other_world:  # a shrink: rank r takes old rank r's
                self._take_resized(f"w{self.other_world}/r{rank}")
        self.fetch_from(peers)
        return self

    def _take_resized(self, old: str) -> None:
        """Old rank r's slots (a larger world size) copied into this key's, the old ones freed: what
        `MemoryRecovery.restore` loads after an elastic shrink, where the state allows it."""
        assert self.client is not None
        fds = self.client.get(old)
        maps = [mmap.mmap(fd, 0) for fd in fds]
        blobs = [bytes(m[: header_end(m)]) for m in maps if header_end(m) > 0]
        for m, fd in zip(maps, fds, strict=True):
            m.close()
            os.close(fd)
        if blobs:
            self._adopt(blobs)
            self.resized_from = self.other_world
            self._tell(lambda client: client.drop(old))

    def fetch_from(self, peers: Sequence[tuple[str, str]]) -> None:
        """Without slots of its own: the first of `peers` that holds this rank's adopts them here.
        `KeeperRefused` (the token is not that keeper's job's) is raised, with its one line."""
        for address, token in peers if not self.slots else ():
            if blobs := fetch(address, self.key, token):
                self._adopt(blobs)
                self.fetched = True
                break

    def wire(self, address: str, token: str) -> None:
        """This host's keeper copies every committed snapshot to the keeper at `address` from now on."""
        self._tell(lambda client: client.buddy(address, token))

    def _adopt(self, blobs: Sequence[bytes]) -> None:
        size = max(len(b) for b in blobs)
        self.slots = [Slot.new(size, f"ddpkit-snapshot-{self.key}-{i}") for i in range(2)]
        for slot, blob in zip(self.slots, blobs, strict=False):
            slot.map[: len(blob)] = blob
        self.seq = max(s.header()[1] for s in self.slots)
        self._hold()

    def _hold(self) -> None:
        self._tell(lambda client: client.hold(self.key, [s.fd for s in self.slots]))

    def _tell(self, request: Callable[[KeeperClient], Any]) -> Any:
        """A request to the keeper, its answer; if it is gone (killed, or the launch is ending), the slots
        stay this process's own (they die with it), nothing more is asked (None): training goes on, disk
        remains."""
        if self.client is None:
            return None
        try:
            return request(self.client)
        except (OSError, EOFError):
            self.client.close()
            self.client = None
            self.lost_keeper = True
            return None

    def held(self) -> dict[int, int]:
        """step -> slot index, for the slots holding a complete snapshot."""
        return {step: i for i, s in enumerate(self.slots) if (step := s.complete_step()) >= 0}

    def agree(self, *, distributed: bool, device: torch.device | str = "cpu") -> int | None:
        """Collective (every rank): the newest step every rank holds whole (`choose`), or None."""
        return self.agree_with(-1, distributed=distributed, device=device)[0]

    def agree_with(
        self, disk: int, *, distributed: bool, device: torch.device | str = "cpu"
    ) -> tuple[int | None, int]:
        """`agree`, and the largest `disk` any rank passed (global rank 0 reads the disk's step), in the
        same all-gather: one collective. Each rank's row (`self.rows` after it, for `why_disk`): its two
        steps, `disk`, whether its slots came from another host, the other world size its keeper holds,
        the world size its slots were taken at when that is another (an elastic shrink)."""
        steps = sorted(self.held(), reverse=True)[:2]
        row = [*steps, *[-1] * (2 - len(steps)), disk, int(self.fetched), self.other_world, self.resized_from]
        mine = torch.tensor(row, dtype=torch.int64, device=device)
        every = [mine]
        if distributed:
            every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(every, mine)
        self.rows = [t.tolist() for t in every]
        return choose([{s for s in r[:2] if s >= 0} for r in self.rows]), max(r[2] for r in self.rows)

    # -- save -------------------------------------------------------------------------------------
    def save(self, step: int, strategy: StateOwner, state: Mapping[str, Any]) -> None:
        """Snapshot `state` as step `step` into the slot not holding the newest complete one."""
        self.settle()  # strict, and no forward since the last commit: its acknowledgement first
        tensors: dict[str, torch.Tensor] = {}
        tree = files.encode(_locals(capture(strategy, state)), tensors, "")
        offsets, end = {}, HEADER
        for path, t in tensors.items():
            offsets[path] = end
            end = -(-(end + t.numel() * t.element_size()) // ALIGN) * ALIGN
        body = json.dumps({"tree": tree, "offsets": offsets, "layout": layout_of(tensors)}).encode()
        slot = self._slot_for(end + len(body))
        self.seq += 1
        slot.begin(self.seq)
        for path, t in tensors.items():
            self.write_tensor(slot, offsets[path], t)
        slot.commit(step, self.seq, body, end)
        self.last_bytes = end + len(body)
        index = self.slots.index(slot)
        reply = self._tell(lambda client: client.committed(self.key, index))
        if reply and reply.get("buddy"):
            self.commits.append(step)
            self.copies += 1
            self.sent_bytes += self.last_bytes
            if self.strict:  # waited for at the next forward (`settle`): the copy overlaps until then
                self.awaiting = True
            else:
                self._bound_lag(int(reply["buddy_step"]), self.lag)

    def settle(self) -> None:
        """buddy="before-next-step", before each forward (a pre-hook) and the next snapshot: wait until
        the buddy holds the last commit (the lag bound at 0); the copy overlaps all that runs until then."""
        if self.awaiting:
            self.awaiting = False
            acked = self._tell(lambda client: client.acked(self.key))
            self._bound_lag(-1 if acked is None else acked, 0)

    def _bound_lag(self, acked: int, lag: int) -> None:
        """At most `lag` snapshots committed here that the buddy does not hold (`BUDDY_LAG`; 0 in the
        strict mode): beyond it the training thread waits for the buddy's acknowledgement, at most
        `lag_wait` seconds; then one line says the copy is behind and training goes on without waiting
        until it catches up."""
        self.commits = [s for s in self.commits if s > acked][-(lag + 2) :]  # a buddy gone: no growth
        if len(self.commits) <= lag or self.buddy_behind:
            self.buddy_behind = self.buddy_behind and len(self.commits) > lag
            self.waits.append(0.0)
            return
        start = time.monotonic()
        while len(self.commits) > lag and time.monotonic() - start < self.lag_wait:
            time.sleep(0.001)
            acked = self._tell(lambda client: client.acked(self.key))
            self.commits = [s for s in self.commits if acked is not None and s > acked]
        self.waited_s += time.monotonic() - start
        self.waits.append(time.monotonic() - start)
        if len(self.commits) > lag:
            self.buddy_behind = True
            print(
                f"ddpkit: {self.key}: the buddy host's keeper holds no copy of this rank's snapshots of "
                f"steps {self.commits} after {self.lag_wait:g} s ({len(self.commits)} behind, {lag} "
                "allowed): training goes on; a host lost before the copy catches up recovers from disk",
                file=sys.stderr,
                flush=True,
            )

    def write_tensor(self, slot: Slot, offset: int, t: torch.Tensor) -> None:
        """One tensor's bytes into the slot (a test replaces this to fault in the middle of a save)."""
        slot.view(offset, t.dtype, t.shape).copy_(t.detach())

    def _slot_for(self, need: int) -> Slot:
        """The slot to write: not the newest complete one; grown (a new segment) when too small."""
        while len(self.slots) < 2:  # the first save: both slots at once, so the keeper holds a pair
            self.slots.append(self._new_slot(need, len(self.slots)))
            if len(self.slots) == 2:
                self._hold()
        held = self.held()
        index = 1 - held[max(held)] if held else 0
        if self.slots[index].size < need:
            self.slots[index].close()
            self.slots[index] = self._new_slot(need, index)
            self._hold()
        return self.slots[index]

    def _new_slot(self, need: int, index: int) -> Slot:
        return Slot.new(int(need * 1.1) + (1 << 20), f"ddpkit-snapshot-{self.key}-{index}")

    # -- restore ----------------------------------------------------------------------------------
    def read(self, step: int) -> tuple[Any, dict[str, torch.Tensor], dict[str, list[Any]]]:
        """The tree, the tensors (copies out of the slot: the next save overwrites it) and the layout."""
        held = self.held()
        if step not in held:
            raise SnapshotMismatch(f"{self.key}: step {step} is not held in memory (held: {sorted(held)})")
        slot = self.slots[held[step]]
        _, _, off, n, _ = slot.header()
        body = json.loads(bytes(slot.map[off : off + n]))
        tensors = {}
        for path, (dtype, shape) in body["layout"].items():
            tensors[path] = slot.view(body["offsets"][path], getattr(torch, dtype), shape).clone()
        if slot.complete_step() != step:  # rewritten while read (not in the protocol: a second writer)
            raise SnapshotMismatch(f"{self.key}: the snapshot of step {step} changed while it was read")
        return body["tree"], tensors, body["layout"]

    def restore(self, step: int, strategy: StateOwner, state: Mapping[str, Any]) -> dict[str, Any]:
        """Load step `step` into the objects of `state`; return its values (the defaults, then saved)."""
        tree, tensors, layout = self.read(step)
        live = capture(strategy, state)
        parts = checkpoint_state.split(state)
        sharded = checkpoint_dcp.split(strategy, parts)
        whole = {f"/modules/{n}/" for n in parts["modules"]} | (
            {f"/sharded/{sharded[0][0]}/"} if sharded else set()
        )
        if differ := mismatch(live, layout, whole):
            raise SnapshotMismatch(
                f"the snapshot in memory does not fit these objects ({differ}): it was taken of another "
                "model, optimizer or layout"
            )
        saved = files.decode(tree, tensors)
        if sharded is not None:
            (name, model), optimizers = sharded
            whole = _as_template(live["sharded"], saved["sharded"])
            strategy.load_sharded_state(model, optimizers, {"model": whole.pop(name), **whole})
        for name, module in parts["modules"].items():
            unwrap(module).load_state_dict(saved["modules"][name])
        for name, obj in parts["shared"].items():
            obj.load_state_dict(saved["shared"][name])
        for name, obj in parts["per_rank"].items():
            if isinstance(obj, torch.Generator):
                obj.set_state(saved["per_rank"][name])
            else:
                obj.load_state_dict(saved["per_rank"][name])
        checkpoint_state.set_rng_state(saved["rng"])
        return {**parts["values"], **saved["values"]}

    def drop(self) -> None:
        """At a clean end: the keeper frees this rank's memory now."""
        self._tell(lambda client: client.drop(self.key))

    def close(self) -> None:
        for slot in self.slots:
            slot.close()
        self.slots = []
        if self.client is not None:
            self.client.close()


def mismatch(live: Any, saved: Mapping[str, list[Any]], whole: Collection[str]) -> str:
    """What keeps the snapshot (`saved`: its layout) from these live objects, or "" when it fits: every
    live tensor must be saved with its dtype and shape, and the modules' tensors (paths under `whole`)
    must be the same set (a fresh optimizer has no state yet: what it lacks is loaded)."""
    tensors: dict[str, torch.Tensor] = {}
    files.encode(_locals(live), tensors, "")
    now = layout_of(tensors)
    keys = [k for k in now if now[k] != saved.get(k)]
    keys += [k for k in saved if k not in now and k.startswith(tuple(whole))]
    return "; ".join(f"{k}: {saved.get(k)} saved, {now.get(k)} now" for k in sorted(keys)[:3])


def header_end(m: mmap.mmap) -> int:
    """The bytes a slot's complete snapshot uses (its tree's end), 0 when it holds none."""
    if len(m) < HEADER:
        return 0
    magic, step, _, off, n, _ = HEAD.unpack_from(m, 0)
    return off + n if magic == MAGIC and step >= 0 else 0


def disk_step(root: Path) -> int:
    """The step of the newest checkpoint under `root` (its manifest, not verified: only to compare with
    memory; the load that takes it verifies it), or -1."""
    for path in files.candidates(root):
        try:
            step = json.loads((path / files.MANIFEST).read_text()).get("step")
        except (OSError, ValueError):
            continue
        return step if isinstance(step, int) else -1
    return -1


class MemoryRecovery:
    """What `s.load(root, ..., memory=N)` arms: at the load, the newest snapshot every rank holds in its
    host's keeper, when it is newer than the newest checkpoint on disk; then a snapshot every N optimizer
    steps, taken at the loader's next batch (`Checkpoints.stop_at_boundary`), where the optimizer, the
    LR scheduler, the user's counters, the RNG streams and the loader position all stand after the same
    step (inside the optimizer step the scheduler would be one step behind). `memory="auto"`: N from
    the measured cost of the first snapshots (`memory_cadence.Cadence`)."""

    def __init__(self, snaps: MemorySnapshots, cadence: Cadence, say: Callable[[str], None] = print) -> None:
        self.snaps, self.cadence, self.say = snaps, cadence, say
        self.last_step: int | None = None
        self.hooked: dict[int, Any] = {}  # id(module) -> its forward pre-hook's handle (strict mode)

    @classmethod
    def attach(
        cls, every: int | bool | str, ctx: CheckpointContext, buddy: str = "behind"
    ) -> MemoryRecovery | None:
        """This rank's slots in the keeper `ddpkit run` started on this host (KEEPER_ENV names it); None,
        said, where none runs (plain torchrun, one process, not Linux): recovery is from disk. Across
        hosts the ranks meet through the job's store (`memory_hosts.meet`, a collective): this host's
        keeper is wired to its buddy's, and a rank whose keeper lacks its slots fetches them."""
        cadence = Cadence.of(every, say=ctx.say, distributed=ctx.distributed, device=ctx.device)
        keeper = os.environ.get(KEEPER_ENV)
        if not keeper or not Arena.available():
            ctx.say(
                "ddpkit: memory snapshots need the keeper `ddpkit run` starts on each host (Linux): none "
                "here, so recovery is from disk only"
            )
            return None
        snaps = MemorySnapshots.attach(keeper, ctx.rank, ctx.world_size)
        peers = meet(ctx, snaps.wire)
        try:
            snaps.fetch_from(peers)
        except KeeperRefused as err:
            print(f"ddpkit: rank {ctx.rank}: {err}; recovery is from disk", file=sys.stderr, flush=True)
        snaps.strict = buddy == "before-next-step"
        return cls(snaps, cadence, ctx.say)

    def restore(self, ctx: CheckpointContext, root: Path | None, state: Mapping[str, Any]) -> dict | None:
        """Collective: the values of the snapshot restored, or None (disk decides, as without memory)."""
        disk = disk_step(root) if ctx.is_main and root is not None else -1
        target, newest_disk = self.snaps.agree_with(disk, distributed=ctx.distributed, device=ctx.device)
        if target is None and (note := why_disk(self.snaps.rows, ctx.world_size)):
            ctx.say(note)
        if target is None or target < newest_disk:
            return None
        resized = max(row[5] for row in self.snaps.rows)
        if resized > 0 and (refusal := resize_refusal(ctx.strategy, state)):
            ctx.say(
                f"ddpkit: the memory snapshots of step {target} are of world size {resized} and this run has "
                f"{ctx.world_size} ranks: {refusal}, so recovery is from disk"
            )
            return None
        try:
            values = self.snaps.restore(target, ctx.strategy, state)
        except SnapshotMismatch as err:
            raise problem(
                f"{err}; the snapshot is not loaded",
                "Resume with the script and objects that took it, or start the job anew (a new `ddpkit "
                "run` starts with an empty keeper)",
            ) from None
        disk_note = f"; newest on disk: step {newest_disk}" if newest_disk >= 0 else ""
        if resized > 0:
            disk_note += (
                f"; world size {resized} -> {ctx.world_size}: the RNG streams of ranks "
                f"{ctx.world_size}..{resized - 1} are dropped, the loader re-split"
            )
        ctx.say(f"ddpkit: resumed from memory at step {target} (every rank's snapshot of it){disk_note}")
        self.last_step = target
        return values

    def at_boundary(self, step: Any, strategy: StateOwner, state: Mapping[str, Any]) -> None:
        """At the loader's next batch: a snapshot when `step` is new and due (a multiple of N)."""
        if not isinstance(step, int) or isinstance(step, bool) or step == self.last_step:
            return
        if self.cadence.due(step, time.perf_counter()):
            if self.snaps.strict:
                self._hook(state)
            start = time.perf_counter()
            self.snaps.save(step, strategy, {**state, "step": step})
            self.cadence.took(time.perf_counter() - start, self.snaps.last_bytes, time.perf_counter())
            self.last_step = step

    def _hook(self, state: Mapping[str, Any]) -> None:
        """buddy="before-next-step": `MemorySnapshots.settle` first before each module's forward."""
        for module in checkpoint_state.split(state)["modules"].values():
            if id(module) not in self.hooked:
                self.hooked[id(module)] = module.register_forward_pre_hook(
                    lambda *_: self.snaps.settle(), prepend=True
                )

    def close(self, *, drop: bool) -> None:
        """At the session's end (the buddy copy's cost said); `drop` (a clean end): the keeper frees this
        rank's memory now."""
        self.snaps.settle()
        snaps = self.snaps
        if snaps.copies:
            self.say(buddy_report(snaps.strict, snaps.copies, snaps.sent_bytes, snaps.waited_s, snaps.waits))
        for handle in self.hooked.values():
            handle.remove()
        self.hooked = {}
        if drop:
            self.snaps.drop()
        self.snaps.close()
