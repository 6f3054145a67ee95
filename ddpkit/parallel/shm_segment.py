"""The shared-memory segment behind `ShmAllReduce`: its layout (per-rank flags and pids, then two
buffers of W slots), how it is created or mapped, and how segments left by killed creators are removed.

Crash-safe: global rank 0 of the group creates the segment as /dev/shm/ddpkit-shm-<pid>-<token>, the
others map it, and it is unlinked as soon as everyone has (also when attaching fails), so the memory is
returned when the processes die, even by kill -9. A segment left by a creator killed within that short
window carries its dead pid in its name and is removed by the next creator on the machine
(`clean_stale_segments`).
"""

import glob
import mmap
import os
import re

import numpy as np
import torch

PREFIX = "ddpkit-shm"
SHM_DIR = "/dev/shm"
_FLAG_STRIDE = 8  # int64 entries: one 64-byte cache line per rank's flag, no false sharing


def alive(pid: int) -> bool:
    """True while `pid` runs; a zombie (killed, not yet reaped by its parent) counts as dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True


def clean_stale_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Remove segments whose creator pid is dead (it was killed before it could unlink); return them."""
    removed = []
    for path in glob.glob(os.path.join(shm_dir, f"{PREFIX}-*")):
        match = re.match(rf"{PREFIX}-(\d+)-", os.path.basename(path))
        if match and not alive(int(match.group(1))):
            try:
                os.unlink(path)
                removed.append(path)
            except OSError:
                pass
    return removed


class Segment:
    """The mapped memory: a header of per-rank flags and pids, then 2 buffers x W slots x chunk bytes."""

    def __init__(self, mm: mmap.mmap, world: int, chunk_bytes: int) -> None:
        self.mm = mm
        header = -(-world * _FLAG_STRIDE * 8 * 2 // 4096) * 4096
        words = np.frombuffer(mm, dtype=np.int64, count=header // 8)
        self.flags = words[: world * _FLAG_STRIDE : _FLAG_STRIDE]
        self.pids = words[world * _FLAG_STRIDE : world * _FLAG_STRIDE * 2 : _FLAG_STRIDE]
        data = torch.frombuffer(mm, dtype=torch.uint8, offset=header, count=2 * world * chunk_bytes)
        self.buffers = data.view(2, world, chunk_bytes)

    @staticmethod
    def size(world: int, chunk_bytes: int) -> int:
        return -(-world * _FLAG_STRIDE * 8 * 2 // 4096) * 4096 + 2 * world * chunk_bytes


def open_segment(path: str, size: int, create: bool) -> mmap.mmap:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, size)
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)
