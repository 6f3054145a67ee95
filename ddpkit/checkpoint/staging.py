"""Shared-memory staging for the writer process: a background save's copy lands where the writer reads it.

    arena.reset()                  # a new save: the segments of the last one are reused (it finished)
    staged = arena.stage(tensor)   # a copy of `tensor` in shared memory (`capture`'s copy, not a clone)
    arena.locate(staged)           # (segment id, byte offset, byte count): what the writer is told

Why: a background save must copy the state anyway (training goes on changing it); copying it straight
into anonymous shared memory (memfd, Linux) lets another process write and hash it with no second copy
and no pickling, and its segments are kept from one save to the next, so later saves fault in no new
pages (DCP caches its staging buffers for the same reason). memfd segments have no name: they vanish
when the last process holding them ends, even by kill -9, so nothing is left in /dev/shm.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from dataclasses import dataclass, field

import torch

_ALIGN = 64
_MIN_SEGMENT = 64 << 20


@dataclass
class Segment:
    id: int
    fd: int
    size: int
    map: mmap.mmap
    base: int  # the address of its first byte in this process
    bytes: torch.Tensor  # the whole segment as uint8
    used: int = 0
    sent: bool = False  # the writer process holds it mapped


@dataclass
class Arena:
    """Segments of shared memory, filled in order at each save and reused by the next."""

    segments: list[Segment] = field(default_factory=list)
    _next_id: int = 0
    _current: int = 0

    @staticmethod
    def available() -> bool:
        return hasattr(os, "memfd_create")

    def reset(self) -> None:
        for segment in self.segments:
            segment.used = 0
        self._current = 0

    def nbytes(self) -> int:
        return sum(s.size for s in self.segments)

    def stage(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of `t` in the arena (CPU, contiguous); an empty tensor is cloned (nothing to write)."""
        n = t.numel() * t.element_size()
        if n == 0:
            return t.detach().to("cpu", copy=True)
        segment = self._room(n)
        start = segment.used
        segment.used = -(-(start + n) // _ALIGN) * _ALIGN
        out = segment.bytes[start : start + n].view(t.dtype).view(t.shape)
        out.copy_(t.detach())
        return out

    def locate(self, t: torch.Tensor) -> tuple[int, int, int] | None:
        """Where a contiguous tensor's bytes are in the arena, or None when it is not in it."""
        if not t.is_contiguous() or t.device.type != "cpu":
            return None
        address, n = t.data_ptr(), t.numel() * t.element_size()
        for segment in self.segments:
            if segment.base <= address and address + n <= segment.base + segment.size:
                return segment.id, address - segment.base, n
        return None

    def _room(self, n: int) -> Segment:
        while self._current < len(self.segments):
            segment = self.segments[self._current]
            if segment.size - segment.used >= n:
                return segment
            self._current += 1
        size = max(_MIN_SEGMENT, -(-n // mmap.PAGESIZE) * mmap.PAGESIZE)
        fd = os.memfd_create(f"ddpkit-checkpoint-{self._next_id}", os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        mapped = mmap.mmap(fd, size)
        whole = torch.frombuffer(mapped, dtype=torch.uint8)
        segment = Segment(self._next_id, fd, size, mapped, whole.data_ptr(), whole)
        self._next_id += 1
        self.segments.append(segment)
        return segment

    def close(self) -> None:
        """Release the segments (the writer process's mappings go with it)."""
        for segment in self.segments:
            del segment.bytes
            with contextlib.suppress(BufferError):  # a staged tensor still referenced keeps the memory
                segment.map.close()
            os.close(segment.fd)
        self.segments.clear()
        self._current = 0
