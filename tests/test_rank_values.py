"""Plain values that differ between the ranks at `s.save` are kept per rank, and each rank resumes with its own.

A value passed to `s.save` (a prefetched batch `X=X`, a per-rank counter, a nested container) used to be
stored once, rank 0's, and `s.load` handed rank 0's back to every rank without a word. Now its digest
joins the all-gather the stateful objects already use: a value that differs is also saved per rank and
restored to each rank, and rank 0 prints one line naming them; a value the same on every rank is saved
once, as before (its digest is all it costs). Two real gloo ranks (the shared pool).
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import ddpkit

DIFFERING = ("number", "fraction", "text", "tensor", "array", "items", "nested")
SAME = ("same_number", "same_text", "same_tensor", "same_array", "same_nested")


def values_of(rank: int) -> dict[str, Any]:
    return {
        "number": 10 + rank,
        "fraction": 0.5 * rank,
        "text": f"rank {rank}",
        "tensor": torch.tensor([rank, 2 * rank]),
        "array": np.array([rank, rank + 1]),
        "items": [rank, rank],
        "nested": {"pair": (rank, [torch.tensor([float(rank)])]), "name": "same"},
        "same_number": 7,
        "same_text": "x",
        "same_tensor": torch.arange(3),
        "same_array": np.ones(2),
        "same_nested": {"pair": (1, [2.0])},
    }


def plain(value: Any) -> Any:
    """A value as comparable plain Python (tensors and arrays to lists, tuples kept)."""
    if isinstance(value, torch.Tensor | np.ndarray):
        return (type(value).__name__, value.tolist())
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(plain(v) for v in value)
    return value


def save_then_load(ckpt: str) -> dict[str, Any]:
    """On each rank: save its own values, then load them back into a fresh set of defaults."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), ddpkit.session(seed=0) as s:
        s.save(ckpt, **values_of(s.rank), step=3)
        said = out.getvalue()
        defaults = {name: None for name in values_of(0)} | {"number": -1}
        loaded = s.load(ckpt, **defaults)
        return {"said": said, "loaded": plain(loaded), "rank": s.rank}


def test_each_kind_of_value_resumes_on_each_rank_with_its_own(pool2: Any, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    results = pool2.run(save_then_load, str(ckpt), timeout=90)
    for result in results:
        rank = result["rank"]
        expected = plain(values_of(rank)) | {"step": 3}
        assert result["loaded"] == expected, f"rank {rank}"
    said = [line for line in results[0]["said"].splitlines() if "kept per rank" in line]
    assert len(said) == 1, results[0]["said"]
    assert said[0].startswith("ddpkit: " + ", ".join(f"{n}=" for n in sorted(DIFFERING)) + " kept per rank")
    assert "kept per rank" not in results[1]["said"]  # one line, on rank 0
    (saved,) = ckpt.glob("ckpt-*")
    for rank in (0, 1):  # the values the same on every rank are saved once, not per rank
        assert sorted(json.loads((saved / f"rank-{rank:05d}.json").read_text())["values"]) == sorted(
            DIFFERING
        )


def test_values_the_same_on_every_rank_are_saved_once(pool2: Any, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    pool2.run(save_same, str(ckpt), timeout=90)
    (saved,) = ckpt.glob("ckpt-*")
    assert "values" not in json.loads((saved / "rank-00001.json").read_text())


def save_same(ckpt: str) -> None:
    with ddpkit.session(seed=0, verbose=False) as s:
        s.save(ckpt, **{n: v for n, v in values_of(0).items() if n in SAME}, step=1)


def test_another_world_size_refuses_a_per_rank_value_asked_for(pool2: Any, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    pool2.run(save_then_load, str(ckpt), timeout=90)
    with ddpkit.session(seed=0, verbose=False) as s:  # in this process: world size 1
        with pytest.raises(ddpkit.DdpkitError, match=r"number= differed between the ranks .* world size 2"):
            s.load(str(ckpt), number=0)
        loaded = s.load(str(ckpt), same_number=0)
    assert loaded["same_number"] == 7 and "number" not in loaded  # not asked for: left out, not rank 0's
