"""The data under FSDP(2) x TP(2) on 4 gloo ranks: split by the data-parallel rank (the two ranks of a
tensor group read the same batch, the two groups different ones), the per-rank seed per data-parallel
rank, the global batch arithmetic over the data-parallel ranks; and on 2 ranks, dropout on a stream the
tensor group holds whole draws one process's mask because the group shares its seed. Rank functions:
tests/tp_ranks.py."""

from __future__ import annotations

import functools

import pytest
from tp_ranks import GPT_PLAN, excess, loader_split, one_process, train

from ddpkit.strategy.tp_options import TPOptions

pytestmark = pytest.mark.numerics  # compared with one process: the default-kernel leg runs it too


def test_a_tensor_group_reads_one_batch_and_shares_one_seed(pool4) -> None:
    ranks = pool4.run(loader_split, TPOptions(tensor=2), timeout=120)
    assert ranks[0]["ids"] == ranks[1]["ids"] and ranks[2]["ids"] == ranks[3]["ids"]
    first, second = ({i for batch in r["ids"] for i in batch} for r in (ranks[0], ranks[2]))
    assert not first & second  # the two groups: other rows
    assert [len(b) for b in ranks[0]["ids"]] == [4, 4]  # global batch 8 over 2 data-parallel ranks
    assert ranks[0]["rank_seed"] == ranks[1]["rank_seed"] != ranks[2]["rank_seed"] == ranks[3]["rank_seed"]
    line = "global batch 8 = 4 per rank x 2 rank(s) x 1 accumulation step(s); the 2 tensor-parallel ranks"
    assert line in ranks[0]["printed"], ranks[0]["printed"]


def test_dropout_on_the_whole_stream_is_one_processs_with_the_groups_seed(pool2) -> None:
    options = TPOptions(tensor=2, plan=GPT_PLAN, min_block_params=1)  # the stream replicated, plain
    kw = dict(model_kw={"dropout": 0.2})
    ranks = pool2.run(functools.partial(train, **kw), "gpt", options, timeout=120)
    ref = one_process("gpt", **kw)
    variants = [one_process("gpt", variant="features", **kw)["states"]]
    used, where = excess(ref["states"], ranks[0]["states"], variants)
    assert used <= 1.0, f"{used:.2f} x verify's tolerance at {where}"
