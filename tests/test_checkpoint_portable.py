"""A checkpoint resumes wherever the user runs next: written under DDP, FSDP (2 real gloo ranks) or one
process, loaded under each of the others. What a user checks: the weights and the optimizer state
loaded are the ones saved (a load copies values: bitwise by construction), and the saved step.

FSDP <- DDP or one process: the weights load (they reshard); the optimizer state of a whole-state
save is refused with a clear message by the FSDP strategy (not loaded into FSDP's sharded optimizer)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from portable_ranks import load, save

import ddpkit

ONE = {}  # env={} : one process, in the test's own process


def _same(saved: dict, loaded: dict, *, optimizer: bool = True) -> None:
    keys = [k for k in saved if optimizer or k.startswith("model/")]
    assert keys and all(k in loaded for k in keys), sorted(set(keys) - set(loaded))
    differ = [k for k in keys if not torch.equal(saved[k], loaded[k])]
    assert not differ, differ
    assert int(loaded["step"]) == 2


@pytest.mark.parametrize("writer", ["fsdp", "ddp"])
def test_a_two_rank_checkpoint_loads_in_one_process(pool2, tmp_path: Path, writer: str) -> None:
    root = str(tmp_path / "ck")
    saved = pool2.run(save, root, writer)[0]
    loaded = load(root, writer, ONE)  # the same script, `python train.py`: one process
    assert loaded["strategy"] != "fsdp" or writer == "ddp"
    _same(saved, loaded)


@pytest.mark.parametrize(("writer", "reader"), [("fsdp", "ddp"), ("ddp", "fsdp"), ("fsdp", "fsdp")])
def test_a_two_rank_checkpoint_loads_under_another_strategy(pool2, tmp_path: Path, writer: str, reader: str) -> None:
    root = str(tmp_path / "ck")
    saved = pool2.run(save, root, writer)[0]
    whole_into_sharded = writer != "fsdp" and reader == "fsdp"
    for loaded in pool2.run(load, root, reader, None, not whole_into_sharded):
        assert loaded["strategy"] == reader
        _same(saved, loaded, optimizer=not whole_into_sharded)


def test_a_one_process_checkpoint_loads_under_two_ranks(pool2, tmp_path: Path) -> None:
    root = str(tmp_path / "ck")
    saved = save(root, "fsdp", ONE)  # strategy="fsdp" in one process: the plain module
    for loaded in pool2.run(load, root, "ddp"):
        _same(saved, loaded)
    for loaded in pool2.run(load, root, "fsdp", None, False):
        _same(saved, loaded, optimizer=False)


def test_a_whole_optimizer_state_into_fsdp_is_refused_with_the_way_out(pool2, tmp_path: Path) -> None:
    root = str(tmp_path / "ck")
    pool2.run(save, root, "ddp")
    with pytest.raises(Exception, match="cannot be loaded into FSDP's sharded optimizer"):
        pool2.run(load, root, "fsdp")
    assert ddpkit  # the refusal is the FSDP strategy's (strategy/fsdp.py check_loadable)
