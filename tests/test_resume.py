"""Exact resume on real gloo ranks: stop anywhere, resume with fresh objects, end bitwise equal.

The precondition of every bitwise claim comes first: two uninterrupted runs agree bitwise. Each run is
`resume_train.train` in the shared rank pool (weights, AdamW moments, LR schedule, the position in the
epoch, and each rank's torch/numpy/Python RNG all matter there).
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from resume_train import EPOCHS, GLOBAL_BATCH, SAMPLES, make_data, reference, resume, same, stop_at, train
from safetensors.torch import load_file
from torch import nn

import ddpkit

pytestmark = pytest.mark.numerics  # .ci/run runs these again under ATEN_CPU_CAPABILITY=default


STEPS_PER_EPOCH = SAMPLES // GLOBAL_BATCH


def test_two_uninterrupted_runs_agree_bitwise(pool2) -> None:
    first = reference(pool2)
    second = pool2.run(train, None, None, 2)  # and the loader's worker processes change nothing
    for rank in (0, 1):
        assert same(first[rank], second[rank]) == [], f"rank {rank}: the run is not deterministic"
    assert first[0]["step"] == EPOCHS * STEPS_PER_EPOCH
    assert same(first[0]["model"], first[1]["model"]) == [], "replicas diverged"
    assert not torch.equal(first[0]["torch_rng"], first[1]["torch_rng"]), "ranks share one RNG stream"


POINTS = {
    "mid-epoch 0": ("step", 3),
    "end of epoch 0": ("step", STEPS_PER_EPOCH),  # saved after the last batch, inside the loop
    "start of epoch 1": ("epoch_end", 0),  # saved after the loop over epoch 0 ended
    "middle of epoch 1": ("step", STEPS_PER_EPOCH + 4),
}


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("point", list(POINTS))
def test_resume_ends_bitwise_like_the_uninterrupted_run(
    pool2, tmp_path: Path, point: str, workers: int
) -> None:
    ckpt = str(tmp_path / "ckpt")
    assert pool2.run(stop_at, ckpt, POINTS[point], workers) == [None, None]
    final = pool2.run(resume, ckpt, workers)
    for rank, (got, want) in enumerate(zip(final, reference(pool2), strict=True)):
        assert (
            same(
                {k: v for k, v in got.items() if k != "seen"}, {k: v for k, v in want.items() if k != "seen"}
            )
            == []
        )
        resumed_steps = len(got["seen"])
        assert got["seen"] == want["seen"][-resumed_steps:], f"rank {rank} saw other batches after resuming"


def test_negative_control_without_the_data_position_the_weights_differ(pool2, tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    pool2.run(stop_at, ckpt, POINTS["middle of epoch 1"], 0)
    final = pool2.run(resume, ckpt, 0, False)  # model, optimizer, RNG restored; epoch 1 restarts at batch 0
    diff = same(final[0]["model"], reference(pool2)[0]["model"])
    assert diff, "restoring the data position made no difference: the exact-resume tests prove nothing"


def test_resume_at_another_world_size_keeps_global_batch_and_position(pool2, tmp_path: Path, capsys) -> None:
    ckpt = str(tmp_path / "ckpt")
    pool2.run(stop_at, ckpt, POINTS["middle of epoch 1"], 0)
    final = train(ckpt, None, 0, verbose=True)  # in this process: world size 1
    out = capsys.readouterr().out
    assert "world size 2 -> 1" in out and "the RNG streams of ranks 1..1 are dropped" in out, out
    kept = "global batch 12 kept (ranks x per rank x accumulation: 2 x 6 x 1 -> 1 x 12 x 1)"
    assert f"loader at epoch 1, sample {4 * GLOBAL_BATCH}, {kept}" in out, out
    ref = reference(pool2)
    global_batches = [sorted(a + b) for a, b in zip(ref[0]["seen"], ref[1]["seen"], strict=True)]
    assert final["seen"] == global_batches[STEPS_PER_EPOCH + 4 :], "the data position moved"


def test_saved_weights_load_into_a_plain_model_without_ddpkit(pool2, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    pool2.run(stop_at, str(ckpt), ("step", 2), 0)
    (saved,) = sorted(ckpt.glob("ckpt-*"))
    weights = load_file(str(saved / "model.safetensors"))
    assert not any(k.startswith("module.") for k in weights)
    plain = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
    plain.load_state_dict(weights)  # strict: every key matches
    assert sorted(p.name for p in saved.iterdir()) == [
        "manifest.json",
        "model.safetensors",
        "rank-00000.json",
        "rank-00000.safetensors",
        "rank-00001.json",
        "rank-00001.safetensors",
        "state.json",
        "state.safetensors",
    ]


def accumulation_run(ckpt: str | None, accumulation: int, stop_after: int | None = None) -> dict:
    """One epoch of global batch 12 with `accumulation` micro-batches per step; the samples of every
    optimizer step. With `stop_after`, save after that many steps and stop; with `ckpt` alone, resume."""
    torch.set_num_threads(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), ddpkit.session(seed=0, accumulation=accumulation) as s:
        model = s.model(nn.Linear(6, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = s.loader(make_data(), batch_size=GLOBAL_BATCH, shuffle=True)
        step = (
            s.load(ckpt, model=model, optimizer=opt, loader=loader, step=0)["step"]
            if stop_after is None and ckpt
            else 0
        )
        steps, current = [], []
        for x, y, idx in loader:
            with s.accumulate(model):
                s.backward(F.cross_entropy(model(x), y))
            current += idx.tolist()
            if s.step(opt).stepped:
                step += 1
                steps.append(sorted(current))
                current = []
                if step == stop_after:
                    s.save(ckpt, model=model, optimizer=opt, loader=loader, step=step)
                    break
    return {"steps": steps, "out": out.getvalue()}


def test_trading_accumulation_for_ranks_keeps_the_global_batch_and_position(pool2, tmp_path: Path) -> None:
    """2 ranks x 3 per rank x 2 micro-batches = 12 saved; 1 rank x 3 x 4 micro-batches = 12 resumed."""
    ckpt = str(tmp_path / "ckpt")
    whole = pool2.run(accumulation_run, None, 2)
    reference = [sorted(a + b) for a, b in zip(whole[0]["steps"], whole[1]["steps"], strict=True)]
    pool2.run(accumulation_run, ckpt, 2, 3)
    resumed = accumulation_run(ckpt, 4)  # in this process: world size 1, accumulation doubled
    kept = "global batch 12 kept (ranks x per rank x accumulation: 2 x 3 x 2 -> 1 x 3 x 4)"
    assert f"loader at epoch 0, sample {3 * GLOBAL_BATCH}, {kept}" in resumed["out"], resumed["out"]
    assert "changed" not in resumed["out"], resumed["out"]
    assert resumed["steps"] == reference[3:], "the resumed steps saw other samples"
