"""What reading a source through s.loader costs per batch, per kind of source (issue 31).

    ddpkit run --nproc 2 benchmarks/data_sources.py

A stream of N tiny samples (a 3-float feature and an id), batch 8 per rank, no model: the loader's own
cost. `map` is a TensorDataset (DistributedSampler); `stream` the index split (each rank reads all N
samples and keeps its half); `presplit` each rank's own half, with one MIN all-reduce per batch so
every rank stops at the shortest rank's last batch. Median of 5 passes, microseconds per batch.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch.utils.data import IterableDataset, TensorDataset

import ddpkit

N = 20_000


class Stream(IterableDataset):
    def __init__(self, start: int = 0, step: int = 1) -> None:
        self.start, self.step = start, step

    def __iter__(self):
        for i in range(self.start, N, self.step):
            yield torch.full((3,), float(i)), i


def main() -> None:
    torch.set_num_threads(1)
    with ddpkit.session(seed=0) as s:
        sources = {
            "map": (TensorDataset(torch.zeros(N, 3), torch.arange(N)), {}),
            "stream": (Stream(), {}),
            "presplit": (Stream(s.rank, s.world_size), {"presplit": True}),
        }
        for name, (source, extra) in sources.items():
            loader = s.loader(source, per_rank_batch_size=8, **extra)
            times = []
            for _ in range(5):
                start, batches = time.perf_counter(), 0
                for _batch in loader:
                    batches += 1
                times.append((time.perf_counter() - start) / batches * 1e6)
            median = statistics.median(times)
            print(f"rank {s.rank} {name:9} {batches} batches per rank: {median:7.1f} us per batch")


if __name__ == "__main__":
    main()
