"""An exact shared-memory all-reduce for CPU ranks on one machine, as a DDP communication hook ("shm").

    state, hook = shm_hook_factory()          # `ddpkit.parallel.shm_hook`: the DDP hook ("shm")
    ddp_model.register_comm_hook(state, hook)

Why: gloo moves gradients between processes on one machine through TCP loopback, about 1.6 GB/s and
0.7 ms per call, while memory copies run at 17-50 GB/s. Here every rank of the machine maps one
shared-memory segment; for each chunk of a gradient bucket a rank writes its gradient (already divided
by the world size) into its own slot, waits at a spin barrier, and sums all slots into its bucket.

Exact: every rank sums the same slots in rank order 0, 1, ..., W-1 with the same kernels, so the result
is bitwise identical on every rank and from run to run; with two ranks it also equals gloo's bits
(a/2 + b/2 is commutative). It is the mean DDP's default hook computes (divide first, then sum).

Crash-safe: the segment is unlinked as soon as every rank has mapped it (`ddpkit.parallel.shm_segment`).
A waiting rank notices a dead peer (by pid) or a timeout and raises instead of hanging.

Falls back to the default gloo/NCCL all-reduce hook, and says why in `state.reason`, when the ranks are
on different machines, cannot share /dev/shm, the bucket is not a CPU float tensor, or the CPU is not
x86-64 (the spin barrier relies on x86's total store order).

Double buffering: chunk k uses buffer k % 2. A rank that writes buffer b again (chunk k + 2) has passed
the barrier of chunk k + 1, which every rank reaches only after reading chunk k: one barrier per chunk.
"""

import contextlib
import mmap
import os
import platform
import secrets
import socket
import time
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.parallel.shm_segment import PREFIX, SHM_DIR, Segment, alive, clean_stale_segments, open_segment

FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)

__all__ = ["FLOATS", "PREFIX", "ShmAllReduce", "clean_stale_segments"]


def _machine_id() -> str:
    """Hostname plus boot id: containers on different machines may share a hostname."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class ShmAllReduce:
    """Hook state: the group, the mapped segment (None when falling back) and the chunk sequence number.

    Construction is collective over `process_group` (default: the whole world).
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        *,
        chunk_mb: float = 16.0,
        timeout: float = 600.0,
    ) -> None:
        world: Any = dist.group.WORLD  # typed Optional; set once the default group exists (it does here)
        self.group: dist.ProcessGroup = process_group if process_group is not None else world
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self.chunk_bytes = max(4096, int(chunk_mb * 2**20) // 4096 * 4096)
        self.timeout = timeout
        self.seq = 0
        self.segment: Segment | None = None
        self.reason = self._attach()
        self._check_pids = self.segment is not None and all(alive(int(p)) for p in self.segment.pids)

    @property
    def active(self) -> bool:
        """True when all-reduces go through shared memory, False when they fall back to the group."""
        return self.segment is not None

    def _attach(self) -> str:
        """Map the segment on every rank; return why shared memory is used or not."""
        if self.world == 1:
            return "one rank: nothing to reduce"
        if platform.machine().lower() not in ("x86_64", "amd64"):
            return f"CPU {platform.machine()} is not x86-64: falling back to {dist.get_backend(self.group)}"
        machines: list[str] = [""] * self.world
        dist.all_gather_object(machines, _machine_id(), group=self.group)
        if len(set(machines)) > 1:
            return f"ranks on {len(set(machines))} machines: falling back to {dist.get_backend(self.group)}"
        size = Segment.size(self.world, self.chunk_bytes)
        name = [""]
        path = ""
        mm: mmap.mmap | None = None
        error = ""
        try:
            if self.rank == 0:
                clean_stale_segments()
                path = os.path.join(SHM_DIR, f"{PREFIX}-{os.getpid()}-{secrets.token_hex(6)}")
                try:
                    mm = open_segment(path, size, create=True)
                    name[0] = path
                except OSError as err:
                    error = f"cannot create {path}: {err}"
            dist.broadcast_object_list(name, src=dist.get_global_rank(self.group, 0), group=self.group)
            if self.rank != 0 and name[0]:
                try:
                    mm = open_segment(name[0], size, create=False)
                except OSError as err:
                    error = f"cannot map {name[0]}: {err}"
            errors: list[str] = [""] * self.world
            dist.all_gather_object(errors, error if name[0] else "no segment", group=self.group)
        finally:
            if path:  # everyone has mapped it (or failed): the name is no longer needed
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
        if failed or mm is None:
            if mm is not None:
                mm.close()
            return f"shared memory unavailable ({'; '.join(failed)}): falling back to gloo"
        self.segment = Segment(mm, self.world, self.chunk_bytes)
        self.segment.pids[self.rank] = os.getpid()
        dist.barrier(group=self.group)  # every pid is written before anyone reads them
        return f"shared memory, {self.world} ranks, {self.chunk_bytes >> 20} MiB chunks, double-buffered"

    # -- one round: every rank writes its slot, then reads the others' -------------------------------
    def publish(self) -> None:
        """One round for a caller that wrote straight into `segment.buffers` (FSDP's shared all-gather
        output, `fsdp_shm`): this rank's part is written; returns once every rank's is."""
        assert self.segment is not None, "publish on an inactive ShmAllReduce"
        self._publish(self.segment)

    def _publish(self, seg: Segment) -> None:
        """This rank's slot is written: raise its flag, then wait until every rank has raised its own."""
        self.seq += 1
        seg.flags[self.rank] = self.seq  # an aligned 8-byte store, after the copy (x86 TSO)
        self._wait(self.seq)

    def _sum_slots(self, slots: torch.Tensor, lo: int, hi: int, out: torch.Tensor) -> None:
        """`out` = the ranks' slots [lo:hi] summed in rank order 0, 1, ..., W-1: the one order of every
        reduction here (all-reduce, reduce-scatter, FSDP's reduce-scatter), so they agree bitwise."""
        torch.add(slots[0, lo:hi], slots[1, lo:hi], out=out)
        for k in range(2, self.world):
            out.add_(slots[k, lo:hi])

    # -- the all-reduce ---------------------------------------------------------------------------
    def all_reduce_mean_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Average `tensor` (contiguous, CPU, floating point) over the ranks, in place; return it."""
        seg = self.segment
        if seg is None:
            raise RuntimeError(f"ddpkit shm all-reduce is not active: {self.reason}")
        flat = tensor.view(-1)
        per_chunk = self.chunk_bytes // flat.element_size()
        for start in range(0, flat.numel(), per_chunk):
            part = flat[start : start + per_chunk]
            n = part.numel()
            slots = seg.buffers[self.seq % 2].view(flat.dtype)  # [world, per_chunk]
            torch.div(part, self.world, out=slots[self.rank, :n])
            self._publish(seg)
            self._sum_slots(slots, 0, n, part)
        return tensor

    def reduce_scatter_mean_(self, tensors: list[torch.Tensor], owners: list[int]) -> None:
        """The mean over ranks of each tensor, in place, but only in the tensors this rank owns
        (`owners[i]` is the rank of `tensors[i]`); the others keep this rank's own values.

        Every rank streams all its tensors (divided by the world size) through its slot, chunk by
        chunk, as `all_reduce_mean_` does, and then sums the slots in rank order only where it owns
        the tensor: per value the same division and the same additions in the same order as
        `all_reduce_mean_`, so an owned tensor ends bitwise equal to what the all-reduce gives, while
        no rank reads or writes the sums of tensors it does not own. Tensors: contiguous, CPU, one
        floating dtype, the same shapes and owners on every rank (`ddpkit.step.shard_exchange`)."""
        seg = self.segment
        if seg is None:
            raise RuntimeError(f"ddpkit shm reduce-scatter is not active: {self.reason}")
        flats = [t.view(-1) for t in tensors]
        if not flats:
            return
        size = flats[0].element_size()
        per_chunk = self.chunk_bytes // size
        offsets, total = [], 0
        for f in flats:
            offsets.append(total)
            total += f.numel()
        for start in range(0, total, per_chunk):
            end = min(start + per_chunk, total)
            slots = seg.buffers[self.seq % 2].view(flats[0].dtype)  # [world, per_chunk]
            pieces = [
                (f[lo - at : hi - at], lo - start, hi - start, owners[i])
                for i, (f, at) in enumerate(zip(flats, offsets, strict=True))
                for lo, hi in [(max(start, at), min(end, at + f.numel()))]
                if lo < hi
            ]
            for part, lo, hi, _ in pieces:
                torch.div(part, self.world, out=slots[self.rank, lo:hi])
            self._publish(seg)
            for part, lo, hi, owner in pieces:
                if owner == self.rank:
                    self._sum_slots(slots, lo, hi, part)

    def reduce_scatter_into_(self, flat_input: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        """`output` (m values) = the mean over ranks of this rank's chunk of `flat_input` (W*m values,
        rank-major: chunk r for rank r), FSDP's reduce-scatter; `flat_input` is left as it was.

        Per round every rank writes each destination's next n values (divided by W) into its slot, side
        by side, and after the barrier sums its own piece of every slot in rank order: per value the
        division and additions of `all_reduce_mean_`, so bitwise what it gives, and every rank sums
        1/W of the round (balanced, unlike `reduce_scatter_mean_`'s owner-per-chunk)."""
        seg = self.segment
        if seg is None:
            raise RuntimeError(f"ddpkit shm reduce-scatter is not active: {self.reason}")
        m, w = output.numel(), self.world
        rows = flat_input.view(w, m)
        out = output.view(-1)
        per = self.chunk_bytes // flat_input.element_size() // w
        for start in range(0, m, per):
            n = min(per, m - start)
            slots = seg.buffers[self.seq % 2].view(flat_input.dtype)  # [world, per_chunk]
            torch.div(rows[:, start : start + n], w, out=slots[self.rank, : w * n].view(w, n))
            self._publish(seg)
            lo, hi = self.rank * n, (self.rank + 1) * n
            self._sum_slots(slots, lo, hi, out[start : start + n])
        return output

    def all_gather_into_(self, output: torch.Tensor) -> torch.Tensor:
        """FSDP's all-gather in place: `output` flat, W equal chunks, this rank's already in its own
        chunk; the others' chunks are copied in (bytes, any dtype) through `all_gather_`."""
        rows = output.view(-1).view(self.world, -1)
        self.all_gather_([[rows[r]] for r in range(self.world)])
        return output

    def all_gather_(self, owned: list[list[torch.Tensor]]) -> None:
        """Rank r's tensors `owned[r]` to every rank, in place (contiguous CPU tensors, the same shapes on
        every rank). Each rank streams its own tensors' bytes through its slot, chunk by chunk, and copies
        the others' slots into their tensors: the parameter publishing of `ddpkit.step.sharding`."""
        seg = self.segment
        if seg is None:
            raise RuntimeError(f"ddpkit shm all-gather is not active: {self.reason}")
        streams = [_ByteStream(ts) for ts in owned]
        for start in range(0, max(st.nbytes for st in streams), self.chunk_bytes):
            slots = seg.buffers[self.seq % 2]  # [world, chunk_bytes] bytes
            streams[self.rank].copy_to(start, slots[self.rank])
            self._publish(seg)
            for r, stream in enumerate(streams):
                if r != self.rank:
                    stream.copy_from(start, slots[r])

    def _wait(self, seq: int) -> None:
        """Wait until every rank has published chunk `seq`.

        Spin first (ranks in lockstep arrive within microseconds), then sleep with a growing pause up to
        1 ms: on a busy machine, where the late peer may be waiting for a core, a spinning rank would
        take that core from it. Peers are checked for death and the timeout every ~10 ms of waiting.
        """
        flags = self.segment.flags  # type: ignore[union-attr]
        spins = 0
        while flags.min() < seq:
            spins += 1
            if spins > 500:
                break
        else:
            return
        start = last_check = time.monotonic()
        pause = 20e-6
        while flags.min() < seq:
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
            now = time.monotonic()
            if now - last_check > 0.01:
                last_check = now
                self._check_peers(now - start > self.timeout)

    def _check_peers(self, timed_out: bool) -> None:
        seg = self.segment
        assert seg is not None
        if self._check_pids:
            for r, pid in enumerate(seg.pids):
                if r != self.rank and not alive(int(pid)):
                    raise RuntimeError(f"ddpkit shm all-reduce: rank {r} (pid {pid}) died while reducing")
        if timed_out:
            late = [r for r, f in enumerate(seg.flags) if f < self.seq]
            raise RuntimeError(
                f"ddpkit shm all-reduce: rank(s) {late} did not arrive within {self.timeout:.0f} s "
                f"(chunk {self.seq})"
            )

    def close(self) -> None:
        if self.segment is not None:
            seg, self.segment = self.segment, None
            del seg.flags, seg.pids, seg.buffers
            with contextlib.suppress(BufferError):  # a view still alive: the mapping goes with the process
                seg.mm.close()

    def __getstate__(self) -> None:
        raise TypeError("ShmAllReduce holds a process's mapping and cannot be pickled")


class _ByteStream:
    """Tensors seen as one run of bytes, so a chunk of the run can be copied out or in."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.parts = [t.reshape(-1).view(torch.uint8) for t in tensors]
        self.nbytes = sum(p.numel() for p in self.parts)

    def _pieces(self, start: int, length: int):  # -> (part slice, offset in the chunk)
        end, offset = start + length, 0
        for part in self.parts:
            lo, hi = max(start, offset), min(end, offset + part.numel())
            if lo < hi:
                yield part[lo - offset : hi - offset], lo - start
            offset += part.numel()

    def copy_to(self, start: int, chunk: torch.Tensor) -> None:
        for piece, at in self._pieces(start, chunk.numel()):
            chunk[at : at + piece.numel()].copy_(piece)

    def copy_from(self, start: int, chunk: torch.Tensor) -> None:
        for piece, at in self._pieces(start, chunk.numel()):
            piece.copy_(chunk[at : at + piece.numel()])
