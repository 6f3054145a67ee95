"""Every kind of per-rank state ddpkit keeps at `s.save`/`s.load`, on 2 ranks that hold different values.

What is claimed (ddpkit/checkpoint/state.py, docs/fault-tolerance.md "What each keyword becomes",
README "Stateful loaders of your own"): the torch, numpy and Python RNG streams, always, per rank (CUDA's
too, on a GPU: not here); a ddpkit loader's position and a `torch.Generator` passed as keywords; a
stream position of the user's own loader (torchdata's `StatefulDataLoader`, a Hugging Face
`IterableDataset`); an object with `state_dict()` whose state differs between the ranks at save (found by
the digest check), or marked `ddpkit_per_rank = True` (an LR scheduler included, which is otherwise one
copy). Each row: both ranks save, draw what comes next (the reference), start over from other state, load,
and must draw the same as their own reference, which differs between the ranks (so rank 0's brought back
everywhere fails). One pool run saves all kinds at once; `ddpkit checkpoint inspect` must list each rank's.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

import ddpkit
from ddpkit.checkpoint import inspect

KINDS = [
    "rng-torch",
    "rng-numpy",
    "rng-python",
    "generator",
    "loader",
    "stateful-dataloader",
    "hf-iterable",
    "differing-object",
    "marked-object",
    "marked-scheduler",
]


class Position:
    """A user's own stateful object: a position in this rank's stream (`state_dict` of plain numbers)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def state_dict(self) -> dict:
        return {"at": self.at}

    def load_state_dict(self, state: dict) -> None:
        self.at = int(state["at"])

    def draw(self) -> int:
        self.at += 1
        return self.at


class MarkedPosition(Position):
    ddpkit_per_rank = True


def _objects(s, rank: int, fresh: bool = False) -> dict:
    """Each keyword's object over this rank's own data, in this rank's own state; `fresh`: in another
    state (the same on both ranks), to load into."""
    from datasets import Dataset
    from torchdata.stateful_dataloader import StatefulDataLoader

    own, rank = rank, -1 if fresh else rank
    data = torch.arange(64, dtype=torch.float32).reshape(64, 1)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0)
    scheduler.ddpkit_per_rank = True  # type: ignore[attr-defined]
    for _ in range(3 + 2 * rank if rank >= 0 else 0):
        scheduler.step()
    objects = {
        "generator": torch.Generator().manual_seed(100 + rank),
        "loader": s.loader(torch.utils.data.TensorDataset(data), batch_size=2, shuffle=True),
        "stateful_dataloader": StatefulDataLoader(list(range(100 * own, 100 * own + 40)), batch_size=2),
        "hf_iterable": Dataset.from_dict(
            {"x": list(range(1000 * own, 1000 * own + 40))}
        ).to_iterable_dataset(),
        "differing_object": Position(10 * rank),
        "marked_object": MarkedPosition(20 * rank),
        "marked_scheduler": scheduler,
    }
    return objects


def _iterators(objects: dict) -> dict:
    return {n: iter(objects[n]) for n in ("loader", "stateful_dataloader", "hf_iterable")}


def _draw(objects: dict, iterators: dict | None = None) -> dict:
    """What comes next from each kind (advancing it). The global streams first: starting an iterator
    draws from torch's (a DataLoader's base seed), so `iterators` None: started after those draws."""
    drawn = {"rng-torch": torch.rand(3), "rng-numpy": np.random.rand(3), "rng-python": random.random()}
    iterators = _iterators(objects) if iterators is None else iterators
    return {
        **drawn,
        "generator": torch.rand(3, generator=objects["generator"]),
        "loader": next(iterators["loader"])[0],
        "stateful-dataloader": next(iterators["stateful_dataloader"]),
        "hf-iterable": next(iterators["hf_iterable"])["x"],
        "differing-object": objects["differing_object"].draw(),
        "marked-object": objects["marked_object"].draw(),
        "marked-scheduler": objects["marked_scheduler"].last_epoch,
    }


def save_draw_load_draw(root: str) -> dict:
    """Advance every kind to this rank's own state, save, draw the reference, start over from other state,
    load, draw again."""
    with ddpkit.session(seed=0, verbose=False) as s:
        torch.manual_seed(1000 + s.rank)
        np.random.seed(2000 + s.rank)
        random.seed(3000 + s.rank)
        objects = _objects(s, s.rank)
        iterators = _iterators(objects)
        for _ in range(3):  # into the epoch: a position, not the start
            for it in iterators.values():
                next(it)
        s.save(root, **objects, step=1)
        reference = _draw(objects, iterators)
        torch.manual_seed(7)  # other state everywhere, the same on both ranks
        np.random.seed(7)
        random.seed(7)
        fresh = _objects(s, s.rank, fresh=True)
        assert s.load(root, **fresh, step=0) == {"step": 1}
        return {"reference": reference, "resumed": _draw(fresh)}


@pytest.fixture(scope="module")
def ranks(pool2, tmp_path_factory) -> tuple[Path, list[dict]]:
    pytest.importorskip("torchdata")
    pytest.importorskip("datasets")
    root = tmp_path_factory.mktemp("kinds") / "ckpt"
    return root, pool2.run(save_draw_load_draw, str(root), timeout=120)


def _same(a, b) -> bool:
    return bool(np.array_equal(np.asarray(a), np.asarray(b)))


@pytest.mark.parametrize("kind", KINDS)
def test_each_rank_gets_its_own_state_of_every_kind_back(ranks, kind: str) -> None:
    _, results = ranks
    mine = [r["reference"][kind] for r in results]
    assert not _same(mine[0], mine[1]), f"{kind}: both ranks hold the same state; the row proves nothing"
    for rank, r in enumerate(results):
        got, want = r["resumed"][kind], r["reference"][kind]
        assert _same(got, want), f"{kind}: rank {rank} resumed at {got}, saved {want}"


def test_inspect_lists_each_ranks_state_and_both_ranks_rng(ranks) -> None:
    root, _ = ranks
    text, ok = inspect.report(root)
    assert ok, text
    for name in ("generator", "loader", "stateful_dataloader", "hf_iterable", "differing_object"):
        line = next((row for row in text.splitlines() if row.strip().startswith(f"{name} (per rank)")), None)
        assert line is not None and "rank 0: " in line and "rank 1: " in line, text
    assert "RNG streams (torch, numpy, Python): 2 of 2 ranks" in text, text
