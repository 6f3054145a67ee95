"""FSDP2's all-gather and reduce-scatter through shared memory, for CPU ranks of one machine.

    comms = fsdp_shm.open_comms()              # collective: maps one ShmAllReduce segment (or says why not)
    note = fsdp_shm.attach(fsdp_modules, comms)  # every FSDPModule: set_custom_all_gather / _reduce_scatter

Why: on CPU ranks FSDP2's collectives go over gloo's TCP loopback (about 1.6 GB/s) and block the main
thread (no side streams on CPU): docs/performance.md section 7 measured 261 ms of all-gather waits and
129 ms of reduce-scatter per step on the 37.8M-parameter MLP. Ranks of one machine can exchange through
a mapped segment at memory-copy speed instead (`ddpkit.parallel.shm_allreduce`).

Exact: the reduce-scatter is `ShmAllReduce.reduce_scatter_into_`: each value divided by the world size,
then summed in rank order 0..W-1, by the one rank that owns it; bitwise what the shm all-reduce gives,
the same from run to run, and (every rank's replica being the owners' bytes, all-gathered) identical
across ranks. With 2 ranks a/2 + b/2 is also gloo's AVG to within rounding of the division order.

All-gather output in shared memory (`SHARED_GATHER`): FSDP2 copies each rank's shard into that rank's
chunk of the all-gather output, which the collective allocates (`AllGather.allocate`), and copies the
whole output out into the parameters afterwards. So the output is handed out from a second segment,
the same region on every rank: FSDP2's copy-in then writes the shard straight where the others read it,
and the all-gather itself is one barrier, no copy (the shard into a slot and the others' slots into a
private output are gone: 2 P per step of parameter bytes P copied, `ddpkit.bench.floor`). Two regions
alternate. Before one is handed out again, the ranks agree (a one-value all-reduce, also a barrier)
that none still holds its previous output (FSDP2 holds an output until it has copied it out, in
forward until the next block's copy-out): with FSDP2's own prefetching, or explicit prefetching one
block ahead, the region is always free; deeper prefetching finds it held at times, and that all-gather
takes a private output through the slots (`held`). The segment is mapped on the first all-gather and
again, larger, if a later block needs more (both collective: every rank asks for the same sizes in the
same order); the reduce-scatter's buffers stay private (`allocate`).

Ops: FSDP2 asks for AVG when it reduces in fp32 or bf16 with no gradient divide factor, which is all
ddpkit sets up (fp16 is refused under FSDP); that goes through shared memory. SUM (fp16's pre/post
divide), PREMUL_SUM (a divide factor), a group that is not the segment's ranks, or a non-CPU tensor go
to the group's own collective (gloo) and are counted in `fallbacks`.

torch: the base classes `AllGather` / `ReduceScatter` live in the private
`torch.distributed.fsdp._fully_shard._fsdp_api` (torch 2.13); they are imported here only, guarded, and
a torch without them (or without the setters) keeps gloo, which `attach`'s note says.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.parallel.shm_allreduce import ShmAllReduce

CHUNK_MB = 4.0  # the sharded step's publishing chunk: as fast as 16 MiB, less resident shared memory
KEEP_PER_SIZE = 2  # a block's all-gather and the prefetched next one's, or a reduce-scatter beside it
SHARED_GATHER = True  # all-gather outputs in a shared segment (module doc); False: private, via the slots
_SETTERS = ("set_custom_all_gather", "set_custom_reduce_scatter")


class ShmComms:
    """One `ShmAllReduce` serving every FSDP unit's all-gathers and reduce-scatters, in call order
    (the same on every rank: FSDP2 runs them on the main thread on CPU), and a second one whose
    buffers are the all-gather outputs (`gather`, module doc). Counts what it did."""

    def __init__(self, shm: ShmAllReduce, shared_gather: bool | None = None) -> None:
        self.shm = shm
        self.shared_gather = (SHARED_GATHER if shared_gather is None else shared_gather) and shm.active
        self.gather: ShmAllReduce | None = None  # the all-gather outputs' segment, once mapped
        self._handed = 0  # all-gather outputs handed out from `gather`: region = count % 2
        self._last: list[weakref.ref[torch.Tensor] | None] = [None, None]  # each region's last output
        self.held = 0  # all-gathers that found their region still held on some rank: private output
        self.shared_gathers = 0  # all-gathers that were one barrier (the output in `gather`)
        self.all_gathers = 0
        self.reduce_scatters = 0
        self.fallbacks = 0  # calls handed to the group's own collective (see the module doc)
        self.keep = KEEP_PER_SIZE  # buffers of one size kept for reuse (`allocate`); 0: none
        self._kept: list[torch.Tensor] = []

    def allocate(self, size: Sequence[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A buffer for FSDP2 (reduce-scatter input and output; the all-gather output when not shared),
        reused from call to call: a freshly mapped 64 MiB buffer costs its page faults on first touch at
        every call (FSDP ranks return freed blocks to the kernel, `cpu_allocator.return_freed_blocks`).
        A kept buffer is handed out as a new view, so its storage's use count says whether FSDP2 still
        holds it (the sharded gradient is a view of the reduce-scatter output until the optimizer sets it
        to None)."""
        numel = math.prod(int(s) for s in size)
        if device.type != "cpu" or not hasattr(torch._C, "_storage_Use_Count"):  # no way to tell: no reuse
            return torch.empty(numel, dtype=dtype, device=device).view(*size)
        same = [buf for buf in self._kept if buf.numel() == numel and buf.dtype == dtype]
        free = [buf for buf in same if _use_count(buf) <= 2]  # the others are held (a prefetch, a gradient)
        if free:
            return free[0].view(*size)
        buf = torch.empty(numel, dtype=dtype)
        if len(same) < self.keep:  # at most `keep` per size stay resident; beyond them, a passing one
            self._kept.append(buf)
        return buf.view(*size)

    def allocate_gather(self, size: Sequence[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An all-gather output: the next region of the shared `gather` segment (module doc), mapped or
        grown here on every rank at once; a private buffer (`allocate`) off CPU or without the segment."""
        numel = math.prod(int(s) for s in size)
        nbytes = numel * dtype.itemsize
        if not self.shared_gather or device.type != "cpu":
            return self.allocate(size, dtype, device)
        if self.gather is None or self.gather.world * self.gather.chunk_bytes < nbytes:
            per_rank = -(-nbytes // self.shm.world // 4096) * 4096  # a region: all W slots of one buffer
            grown = ShmAllReduce(self.shm.group, chunk_mb=per_rank / 2**20, timeout=self.shm.timeout)
            if not grown.active:  # the ranks agree (ShmAllReduce gathers every rank's error)
                self.shared_gather = False
                return self.allocate(size, dtype, device)
            if self.gather is not None:  # unmapped once FSDP2 drops its last output in it
                self.gather.close()
            self.gather = grown
        seg = self.gather.segment
        assert seg is not None
        at = self._handed % 2
        last = self._last[at]
        vote = torch.tensor([0.0 if last is None or last() is None else 1.0])
        self.shm.all_reduce_mean_(vote)  # a barrier: every rank is here, done with what it copied out
        if vote.item() > 0:  # some rank still holds the region's last output (a deep prefetch)
            self.held += 1
            return self.allocate(size, dtype, device)
        self._handed += 1
        output = seg.buffers[at].view(-1)[:nbytes].view(dtype).view(*size)
        self._last[at] = weakref.ref(output)
        return output

    def _in_gather(self, output: torch.Tensor) -> bool:
        seg = self.gather.segment if self.gather is not None else None
        if seg is None:
            return False
        base = seg.buffers.data_ptr()
        return base <= output.data_ptr() < base + seg.buffers.numel()

    def _ours(self, group: dist.ProcessGroup, *tensors: torch.Tensor) -> bool:
        return (
            self.shm.active
            and group.size() == self.shm.world
            and group.rank() == self.shm.rank
            and all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)
        )

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> Any:
        if not self._ours(group, output, input):
            self.fallbacks += 1  # (an output in `gather`: every rank writes the same bytes into it)
            return dist.all_gather_into_tensor(output, input, group=group, async_op=async_op)
        n = input.numel()
        mine = output.view(-1)[self.shm.rank * n : (self.shm.rank + 1) * n]
        if mine.data_ptr() != input.data_ptr():  # FSDP2 copies in place; a caller that did not, gets it
            mine.copy_(input.view(-1))
        if self._in_gather(output):  # every rank wrote its chunk of the one shared output
            assert self.gather is not None
            self.gather.publish()
            self.shared_gathers += 1
        else:
            self.shm.all_gather_into_(output)
        self.all_gathers += 1
        return None  # done: FSDP2 waits on no work

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> Any:
        if op != dist.ReduceOp.AVG or not input.is_floating_point() or not self._ours(group, output, input):
            self.fallbacks += 1
            return dist.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)
        self.shm.reduce_scatter_into_(input, output)
        self.reduce_scatters += 1
        return None

    def close(self) -> None:
        self._kept.clear()
        if self.gather is not None:
            self.gather.close()
        self.shm.close()


def _use_count(buf: torch.Tensor) -> int:
    """References to `buf`'s storage: `buf` itself, the temporary storage object, and any view."""
    return int(torch._C._storage_Use_Count(buf.untyped_storage()._cdata))


def open_comms(timeout: float = 600.0) -> ShmComms:
    """Collective over the world: map the segment (falls back inside, `comms.shm.reason` says why)."""
    return ShmComms(ShmAllReduce(chunk_mb=CHUNK_MB, timeout=timeout))


def missing_api() -> str:
    """Why this torch cannot take custom FSDP2 collectives, or "" when it can."""
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter  # noqa: F401
    except ImportError as err:
        return f"torch {torch.__version__} has no FSDP2 custom collectives ({err})"
    absent = [name for name in _SETTERS if not hasattr(FSDPModule, name)]
    return f"torch {torch.__version__}'s FSDPModule lacks {', '.join(absent)}" if absent else ""


def attach(modules: Sequence[Any], comms: ShmComms) -> str:
    """Give every FSDPModule in `modules` the shared-memory all-gather and reduce-scatter; return the
    note ddpkit prints (which path the collectives take, and why)."""
    backend = dist.get_backend()
    why = missing_api() or ("" if comms.shm.active else comms.shm.reason)
    if why:
        return f"FSDP2 collectives over {backend} ({why})"
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    class ShmAllGather(AllGather):
        def allocate(self, size: Sequence[Any], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return comms.allocate_gather(size, dtype, device)

        def __call__(
            self,
            output_tensor: torch.Tensor,
            input_tensor: torch.Tensor,
            group: dist.ProcessGroup,
            async_op: bool = False,
        ) -> Any:
            return comms.all_gather(output_tensor, input_tensor, group, async_op)

    class ShmReduceScatter(ReduceScatter):
        def allocate(self, size: Sequence[Any], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return comms.allocate(size, dtype, device)

        def __call__(
            self,
            output_tensor: torch.Tensor,
            input_tensor: torch.Tensor,
            group: dist.ProcessGroup,
            op: Any,
            async_op: bool = False,
        ) -> Any:
            return comms.reduce_scatter(output_tensor, input_tensor, group, op, async_op)

    for module in modules:
        module.set_custom_all_gather(ShmAllGather())
        module.set_custom_reduce_scatter(ShmReduceScatter())
    shm = comms.shm
    return (
        f"FSDP2 collectives (all-gather, reduce-scatter) through shared memory: {shm.world} ranks on "
        f"this machine, {shm.chunk_bytes >> 20} MiB chunks, mean summed in rank order (exact)"
        f"{', all-gather outputs in shared memory' if comms.shared_gather else ''}; "
        f"FSDPOptions(shm=False) keeps {backend}"
    )
