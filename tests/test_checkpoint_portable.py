"""A checkpoint resumes wherever the user runs next: written under DDP, FSDP (2 real gloo ranks) or one
process, loaded under each of the others. What a user checks: the weights and the optimizer state
loaded are the ones saved (a load copies values: bitwise by construction), and the saved step.

FSDP <- DDP or one process: the weights reshard, and the optimizer state saved whole is cut into each
rank's shards (the same values); an optimizer built over other parameters is refused, with the way out."""

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
def test_a_two_rank_checkpoint_loads_under_another_strategy(
    pool2, tmp_path: Path, writer: str, reader: str
) -> None:
    root = str(tmp_path / "ck")
    saved = pool2.run(save, root, writer)[0]
    for loaded in pool2.run(load, root, reader):
        assert loaded["strategy"] == reader
        _same(saved, loaded)


def test_a_one_process_checkpoint_loads_under_two_ranks(pool2, tmp_path: Path) -> None:
    root = str(tmp_path / "ck")
    saved = save(root, "fsdp", ONE)  # strategy="fsdp" in one process: the plain module
    for loaded in pool2.run(load, root, "ddp"):
        _same(saved, loaded)
    for loaded in pool2.run(load, root, "fsdp"):
        _same(saved, loaded)


def load_other_optimizer(root: str) -> None:
    """FSDP: an optimizer over only the first layer, loading a whole state saved for the whole model."""
    from torch import nn

    with ddpkit.session(seed=1, verbose=False, strategy="fsdp") as s:
        model = s.model(
            nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
        )
        opt = torch.optim.AdamW(model[0].parameters(), lr=1e-2)
        s.load(root, model=model, optimizer=opt, step=0)


def test_a_whole_optimizer_state_for_other_parameters_is_refused_with_the_way_out(
    pool2, tmp_path: Path
) -> None:
    root = str(tmp_path / "ck")
    pool2.run(save, root, "ddp")
    with pytest.raises(
        Exception, match=r"holds optimizer= for 6 parameters.*this optimizer has 2.*same order"
    ):
        pool2.run(load_other_optimizer, root)
