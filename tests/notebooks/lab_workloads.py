"""Workloads the course labs run under test (tests/test_notebooks.py injects them as the labs' parameters).

A reader's run keeps the lab's default; the test proves the lab runs top to bottom and prints its
conclusion, which does not need the default's size."""

from __future__ import annotations

import dataclasses
import functools

from ddpkit.tools import workloads


def narrow_mlp() -> workloads.Workload:
    """Lab 2's `mlp` narrowed from 4096 to 1024 wide: the same shape (a few large matrix products, AdamW,
    global batch 64), 2.1M parameters (8 MB of gradients) instead of 38M, at a step of milliseconds instead
    of half a second. Its gradients still fill two DDP buckets (the first one capped at 1 MB), so the
    last layers' all-reduce can run behind the first layers' backward, as the lab's trace shows."""
    mlp = workloads.load("mlp")
    return dataclasses.replace(
        mlp, name="mlp-narrow", build=functools.partial(workloads.make_mlp, (1024, 1024, 1024, 10))
    )
