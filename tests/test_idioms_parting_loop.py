"""A collective call only global rank 0 reaches (`s.save`, `s.gather`, `s.any_rank` under `if s.is_main:`),
at several steps of a real loop under `ddpkit run` on 2 and 3 ranks, is always refused by name: on rank 0
(the launcher's headline) and on every other rank still in the job (its own line), never by gloo's abort
of a collective of the wrong size; a rank that finished its loop is named as having left its session.
Other pairs of calls meet in the shared pools: both ranks are told both calls."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, run_cli
from torch import nn

import ddpkit
from ddpkit.errors import DdpkitError

JOB = str(REPO / "tests" / "idioms_parting_job.py")
NAMES = {"save": "s.save", "gather": "s.gather", "any_rank": "s.any_rank"}
# What the backend says when ranks meet in collectives of different sizes, or one dies under the other.
GLOO = ("EnforceNotMet", "Received data size", "collective mismatch", "Connection closed by peer", "gloo::")
LAST = 3  # the loop's last step: the other ranks end their session while rank 0 is at the call


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("world", "call", "at"),
    [
        (2, "save", 0),
        (2, "save", LAST),
        (3, "save", 1),
        (3, "save", LAST),
        (2, "gather", 1),
        (3, "any_rank", 2),
    ],
)
def test_a_call_only_rank_0_reaches_is_refused_by_name_on_every_rank(
    tmp_path: Path, world: int, call: str, at: int
) -> None:
    started = time.monotonic()
    done = run_cli("run", "--nproc", str(world), JOB, str(tmp_path / "ck"), call, str(at), timeout=120)
    took, err = time.monotonic() - started, done.stderr
    assert done.returncode == 1, err[-3000:]
    name = re.escape(NAMES[call])
    heads = [line for line in err.splitlines() if re.match(r"ddpkit run: (?!warning)", line)]
    assert len(heads) == 1 and re.match(
        rf"ddpkit run: rank 0 called {name} at idioms_parting_job.py:", heads[0]
    ), err[-3000:]
    assert "the ranks parted at the session's collective call 1" in heads[0], heads[0]
    assert f"Call {NAMES[call]} on every rank at the same point, outside `if s.is_main:`" in heads[0], heads[
        0
    ]
    others = range(1, world)
    if at == LAST:  # the others finished the loop: named by the line their session ended at
        for r in others:
            assert (
                f"rank {r} had left its session (its `with ddpkit.session(...)` ended at idioms_parting_job"
                in (heads[0])
            ), heads[0]
    else:  # the others wait in the next step's collective: each says the verdict itself
        for r in others:
            assert f"rank {r} is in " in heads[0], heads[0]
            assert re.search(rf"ddpkit: rank {r}: rank 0 called {name} at ", err), err[-3000:]
    for text in GLOO:
        assert text not in err, err[-3000:]
    assert took < 55, f"{took:.0f} s: the refusal waited for a limit"  # the save limit is 60 s
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())


def _part(first: str) -> str:
    """Global rank 0 calls `first`, every other rank s.any_rank: each rank's refusal, as text."""
    with ddpkit.session(verbose=False) as s:
        s.model(nn.Linear(3, 2))
        try:
            if s.rank == 0:
                getattr(s, first.removeprefix("s."))(torch.ones(3))
            else:
                s.any_rank(True)
        except DdpkitError as exc:
            return str(exc)
        return "no refusal"


@pytest.mark.parametrize("pool", ["pool2", "pool3"])
def test_a_gather_against_an_any_rank_is_refused_on_every_rank(request, pool: str) -> None:
    ranks = request.getfixturevalue(pool)
    told = ranks.run(_part, "s.gather")
    assert re.match(
        r"rank 0 called s.gather at \S+\.py:\d+: .*, but rank \d called s.any_rank at", told[0]
    ), told
    for r, text in enumerate(told[1:], 1):
        assert re.match(
            rf"rank {r} called s.any_rank at \S+\.py:\d+: .*, but rank 0 called s.gather at", text
        ), told
    assert all("the ranks parted at the session's collective call 1" in t for t in told), told


def _tags_kept() -> list[bool]:
    """After five s.any_rank calls: whether this rank's tags of calls 1..5 are still in the store."""
    with ddpkit.session(verbose=False) as s:
        for _ in range(5):
            s.any_rank(False)
        group = s._group
        assert group is not None
        return [group.store.check([f"{group.prefix}/call/{n}/{s.rank}"]) for n in range(1, 6)]


def test_a_scripts_per_step_tags_do_not_pile_up_in_the_store(pool2) -> None:
    for kept in pool2.run(_tags_kept):
        assert kept == [False, False, False, True, True], kept  # the last two: a peer may still read them
