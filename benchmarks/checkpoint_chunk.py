"""The checkpoint writer's CPU time per piece size: hash + write + fsync of 448 MiB from shared memory.

    python benchmarks/checkpoint_chunk.py            # 4 interleaved rounds of 8 MiB, 1 MiB, 256 KiB

Runs `ddpkit/checkpoint/writer_child.py`'s `write_file` (what the writer process does for each big file)
on a memfd segment, with its `CHUNK` set to each size in turn; prints the median CPU time (user +
system of this process: the hashing, and the kernel's copy into the page cache) and wall time. A piece
hashed and then written while it is still in the core's cache is read from memory once, not twice.
No torch: run it beside nothing else (`flock /tmp/ddpkit-cpu.lock ...`).
"""

from __future__ import annotations

import base64
import importlib.util
import mmap
import os
import statistics
import tempfile
import time
from pathlib import Path

CHILD = Path(__file__).resolve().parent.parent / "ddpkit" / "checkpoint" / "writer_child.py"


def main(rounds: int = 4, size: int = 448 << 20) -> None:
    spec = importlib.util.spec_from_file_location("writer_child", CHILD)
    assert spec is not None and spec.loader is not None
    child = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(child)
    fd = os.memfd_create("ddpkit-chunk-bench")
    os.ftruncate(fd, size)
    memory = mmap.mmap(fd, size)
    for i in range(0, size, 1 << 20):  # not all zeros (a sparse page could be skipped)
        memory[i : i + (1 << 20)] = os.urandom(1 << 10) * 1024
    path = os.path.join(tempfile.gettempdir(), f"ddpkit-chunk-bench-{os.getuid()}.bin")
    request = {"path": path, "head": base64.b64encode(b"{}").decode(), "pieces": [[0, 0, size]]}
    times: dict[int, list[tuple[float, float]]] = {}
    for _ in range(rounds):
        for chunk in (8 << 20, 1 << 20, 256 << 10):
            child.CHUNK = chunk
            c0, t0 = time.process_time(), time.perf_counter()
            child.write_file(request, {0: memory})
            times.setdefault(chunk, []).append((time.process_time() - c0, time.perf_counter() - t0))
            os.unlink(path)
    print(f"checkpoint_chunk: {size >> 20} MiB, {rounds} rounds; load {os.getloadavg()[0]:.1f}")
    for chunk, v in times.items():
        cpu, wall = [c for c, _ in v], statistics.median(w for _, w in v)
        print(
            f"  {chunk >> 10:5d} KiB pieces: CPU {statistics.median(cpu):.2f} s "
            f"[{min(cpu):.2f}..{max(cpu):.2f}], wall {wall:.2f} s"
        )


if __name__ == "__main__":
    main()
