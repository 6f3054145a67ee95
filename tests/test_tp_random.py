"""Random draws under tensor parallelism on 2 gloo ranks: dropout on the sequence-parallel stream (a
DTensor sharded along the sequence) draws one process's masks (each rank draws the whole mask from the
stream its tensor group shares and keeps its slice), so training with dropout equals one process within
verify's floor; without ddpkit's draws every shard would draw the same mask. Rank functions:
tests/tp_ranks.py."""

from __future__ import annotations

import functools

import pytest
from tp_ranks import GPT_VOCAB_PLAN, excess, one_process, train

from ddpkit.strategy.tp_options import TPOptions

pytestmark = pytest.mark.numerics  # compared with one process: the default-kernel leg runs it too


def test_dropout_on_the_sequence_parallel_stream_is_one_processs(pool2) -> None:
    options = TPOptions(tensor=2, plan=GPT_VOCAB_PLAN, sequence_parallel=True, min_block_params=1)
    kw = dict(model_kw={"dropout": 0.2}, reseed=5)
    ranks = pool2.run(functools.partial(train, **kw), "gpt", options, timeout=120)
    ref = one_process("gpt", **kw)
    variants = [one_process("gpt", variant=v, **kw)["states"] for v in ("features",)]
    got = ranks[0]
    assert got["draws"][0] > 0  # masks drawn whole and sliced (4 dropouts x 3 steps, at least)
    assert got["placements"]["norm.weight"][-1] == "Replicate"  # sequence parallel: the norm a DTensor
    used, where = excess(ref["states"], got["states"], variants)
    assert used <= 1.0, f"{used:.2f} x verify's tolerance at {where}"
