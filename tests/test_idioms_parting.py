"""Ranks that part at the session's collectives (`s.save` under `if s.is_main:`, `s.load` against
`s.all_reduce`) are refused by name in seconds: each call is tagged in the store first
(`ddpkit.cluster.lifecycle.Membership.agree`), never met by a collective of the wrong size."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from torch import nn

import ddpkit
from ddpkit.errors import DdpkitError

# The port of a script whose checkpoint block ran on rank 0 only: `s.save` put where `torch.save` was.
# The collective limit (600 s) is far above the test's own: a refusal that waited for it would fail here.
PORT = """
import sys, torch, ddpkit
from torch import nn
with ddpkit.session(timeout=600, verbose=False) as s:
    model = s.model(nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for step in range(4):
        with s.accumulate(model):
            s.backward(model(torch.randn(8, 4)).sum())
        s.step(opt)
        if step == 1 and s.is_main:
            s.save(sys.argv[1], model=model, optimizer=opt, step=step)
"""


@pytest.mark.timeout(120)
def test_a_save_only_rank_0_reaches_is_refused_naming_s_save_and_rank_1s_call(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(PORT))
    done = run_cli("run", "--nproc", "2", str(script), str(tmp_path / "ck"), timeout=90)
    assert done.returncode == 1, done.stderr[-3000:]
    heads = [line for line in done.stderr.splitlines() if line.startswith("ddpkit run:")]
    assert len(heads) == 1, done.stderr[-3000:]
    said = (
        r"rank 0 called s.save at job.py:12: s.save\(.*\), but rank 1 is in backward: DDP's gradient "
        r"all-reduce at \S*job.py:9 in <module>: s.backward\(.*\): the ranks parted at the session's "
        r"collective call 1 .*Call s.save on every rank at the same point, outside `if s.is_main:`"
    )
    assert re.match(rf"ddpkit run: {said}", heads[0]), done.stderr[-3000:]
    assert re.search(rf"ddpkit: rank 1: {said}", done.stderr), done.stderr[-3000:]  # told on rank 1 too
    assert "Received data size" not in done.stderr  # never met by a collective of another size
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())


def _part(root: str, first: str) -> str:
    """Rank 0 calls `first` (s.save or s.load), rank 1 s.all_reduce: each rank's refusal, as text."""
    with ddpkit.session(verbose=False, save_timeout=60) as s:
        model = s.model(nn.Linear(3, 2))
        try:
            if s.rank == 0:
                getattr(s, first.removeprefix("s."))(root, model=model, step=1)
            else:
                s.all_reduce(torch.ones(3))
        except DdpkitError as exc:
            return str(exc)
        return "no refusal"


@pytest.mark.parametrize("first", ["s.save", "s.load"])
def test_ranks_at_different_calls_are_both_told_both_calls(pool2, tmp_path: Path, first: str) -> None:
    zero, one = pool2.run(_part, str(tmp_path / "ck"), first)
    assert re.match(rf"rank 0 called {first} at \S+\.py:\d+: .*, but rank 1 called s.all_reduce at", zero), (
        zero
    )
    assert re.match(rf"rank 1 called s.all_reduce at \S+\.py:\d+: .*, but rank 0 called {first} at", one), one
    for text in (zero, one):
        assert "the ranks parted at the session's collective call 1" in text and "\n" not in text, text


def _tags(steps: int) -> list[int]:
    """The session's tagged calls after a hand loop, after one s.all_reduce, after ddpkit.fit's steps."""
    with ddpkit.session(verbose=False) as s:
        model = s.model(nn.Linear(3, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        data = torch.utils.data.TensorDataset(torch.randn(16, 3), torch.randn(16, 2))
        for x, y in s.loader(data, batch_size=4):
            with s.accumulate(model):
                s.backward(nn.functional.mse_loss(model(x), y))
            s.step(opt)
        assert s._group is not None
        counts = [s._group._calls]
        s.all_reduce(1.0)
        counts.append(s._group._calls)
        step = lambda m, batch: nn.functional.mse_loss(m(batch[0]), batch[1])  # noqa: E731
        ddpkit.fit(s, model, opt, s.loader(data, batch_size=4), step, epochs=1, progress=False)
        counts.append(s._group._calls)
        return counts


def test_the_training_step_carries_no_tag_and_a_scripts_all_reduce_one(pool2) -> None:
    for counts in pool2.run(_tags, 2):
        assert counts == [0, 1, 1], counts  # fit's per-step all-reduce is ddpkit's own: not tagged
