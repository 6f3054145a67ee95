"""Batch arithmetic: how many samples a micro-batch holds, and a micro-batch cut into equal parts.

    n = batch_len(batch)                       # the first dimension of the batch's first tensor
    for piece, weight in split(batch, parts):  # micro_batch="auto": parts of n/parts, each loss x weight

A batch is whatever the loader yields: a tensor, a sequence or mapping of them (named tuples and
mappings keep their type), anything else passed through whole. Used by `ddpkit.fit` (throughput, the
re-run after an out-of-memory error: `ddpkit.training.oom_retry`) and the estimate ahead under FSDP
(`ddpkit.training.oom_ahead`).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

import torch

from ddpkit.errors import problem


def batch_len(batch: Any) -> int:
    """The first dimension of the batch's first tensor (0 when it holds none)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 0
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            n = batch_len(item)
            if n:
                return n
    return 0


def _take(batch: Any, start: int, stop: int, n: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[start:stop] if batch.dim() and batch.shape[0] == n else batch
    if isinstance(batch, Mapping):
        return type(batch)({k: _take(v, start, stop, n) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*(_take(v, start, stop, n) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_take(v, start, stop, n) for v in batch)
    return batch


def split(batch: Any, parts: int) -> list[tuple[Any, float]]:
    """`batch` as `parts` consecutive pieces along the first dimension (every tensor whose first
    dimension is the batch's), each with the weight that keeps a mean loss that of the whole batch:
    n_part x parts / n (1.0 exactly for equal pieces). Refused when a piece would be empty."""
    if parts == 1:
        return [(batch, 1.0)]
    n = batch_len(batch)
    if n < parts:
        raise problem(
            f"a micro-batch of {n} sample(s) cannot be split into {parts} parts after running out of memory"
            " again",
            "Even one sample per micro-batch does not fit: use FSDP (strategy='fsdp'), activation "
            "checkpointing (s.model(..., activation_checkpointing='auto')) or bf16; `ddpkit plan --memory` "
            "estimates each",
        )
    bounds = [round(i * n / parts) for i in range(parts + 1)]
    return [(_take(batch, a, b, n), (b - a) * parts / n) for a, b in itertools.pairwise(bounds)]
