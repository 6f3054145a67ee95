"""What a checkpoint's shard checksum costs: seconds per GB for SHA-256, BLAKE2b and CRC-32, on this CPU.

    flock /tmp/ddpkit-cpu.lock .venv/bin/python benchmarks/checksum_cost.py            # 256 MiB, 5 rounds
    flock /tmp/ddpkit-cpu.lock .venv/bin/python benchmarks/checksum_cost.py --mib 1024 --rounds 7

Each rank's shard file is hashed as it is written (`ddpkit.checkpoint.writer_child`, `write.stream_tensors`:
1 MiB slices that release the GIL) and every file is hashed again when a load verifies the checkpoint. So
the figure that matters is the hash's time per GB next to the write's own: one buffer of random bytes
(`--mib`) is hashed in the writer's 1 MiB slices by each algorithm (hashlib.sha256, hashlib.blake2b,
zlib.crc32), and written with fsync to a temporary file (the write the hash rides on), in rounds whose order
is shuffled, one thread. Printed: the median seconds per GB with [min, max] over rounds, and each hash as a
share of the write. `uptime`'s load is printed before and after.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import statistics
import tempfile
import time
import zlib
from collections.abc import Callable

from ddpkit.bench.report import load_note

SLICE = 1 << 20  # the writer's slice (`writer_child.CHUNK`)


def _hashlib(name: str) -> Callable[[memoryview], str]:
    def run(data: memoryview) -> str:
        digest = hashlib.new(name)
        for start in range(0, len(data), SLICE):
            digest.update(data[start : start + SLICE])
        return digest.hexdigest()

    return run


def _crc32(data: memoryview) -> str:
    crc = 0
    for start in range(0, len(data), SLICE):
        crc = zlib.crc32(data[start : start + SLICE], crc)
    return f"{crc:08x}"


def _write(directory: str) -> Callable[[memoryview], str]:
    def run(data: memoryview) -> str:
        path = os.path.join(directory, "shard.bin")
        with open(path, "wb", buffering=0) as f:
            for start in range(0, len(data), SLICE):
                piece = data[start : start + SLICE]
                while piece:
                    piece = piece[f.write(piece) :]
            os.fsync(f.fileno())
        os.unlink(path)
        return ""

    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256, help="the buffer hashed and written, in MiB")
    p.add_argument("--rounds", type=int, default=5)
    ns = p.parse_args(argv)
    data = memoryview(os.urandom(ns.mib << 20))
    gb = len(data) / 1e9
    before = os.getloadavg()
    with tempfile.TemporaryDirectory() as directory:
        ways = {
            "sha256": _hashlib("sha256"),
            "blake2b": _hashlib("blake2b"),
            "crc32": _crc32,
            "write+fsync": _write(directory),
        }
        times: dict[str, list[float]] = {name: [] for name in ways}
        order = list(ways)
        rng = random.Random(0)
        for name in order:  # warm-up: the buffer's pages, the disk's cache
            ways[name](data)
        for _ in range(ns.rounds):
            rng.shuffle(order)
            for name in order:
                start = time.perf_counter()
                ways[name](data)
                times[name].append((time.perf_counter() - start) / gb)
    after = os.getloadavg()
    write = statistics.median(times["write+fsync"])
    print(
        f"checksum_cost: {ns.mib} MiB in 1 MiB slices, {ns.rounds} rounds, one thread; load {before[0]:.2f}"
    )
    for name, values in times.items():
        med = statistics.median(values)
        share = "" if name == "write+fsync" else f"  = {med / write:.0%} of the write"
        print(f"  {name:12s} {med:6.3f} s/GB [{min(values):.3f}, {max(values):.3f}]{share}")
    print(load_note(before, after, len(os.sched_getaffinity(0))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
