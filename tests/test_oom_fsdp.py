"""`micro_batch="auto"` under FSDP: the split is chosen before the first step, from the step's peak
estimated on fake tensors against the rank's memory budget (`ddpkit.training.oom_ahead`), agreed over
the ranks once, and then run exactly as a split after an out-of-memory error under DDP: the weights are
those of a run whose loader gave the smaller micro-batch with twice the accumulation (within the
accumulation floor of tests/test_accumulate.py: the same samples per step, summed in another order).

The budget is imposed with DDPKIT_STEP_MEMORY_MIB (the documented override of what ddpkit reads: the
cgroup limit on CPU ranks, the GPU's memory on CUDA): first generous (no split, the estimate's figures
read back), then 80 % of the estimated whole step, which only the half micro-batch fits.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from recording import Recorder
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.names import STEP_MEMORY_ENV

FLOOR = 1e-5  # k micro-batches of b against one batch of k*b (tests/test_accumulate.py)
PER_RANK = 256  # samples per loader micro-batch: its activations are most of the step (21 KiB of weights)
STEPS = 3


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))


def _dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    n = 2 * 2 * PER_RANK * STEPS
    return TensorDataset(torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g))


def _loss(m: nn.Module, b: list[torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(m(b[0]), b[1])


def _loss_read(m: nn.Module, b: list[torch.Tensor]) -> torch.Tensor:
    """The same loss, read as a number in the step (a NaN guard): fake tensors hold no value to read."""
    loss = F.cross_entropy(m(b[0]), b[1])
    if not math.isfinite(loss.item()):
        raise FloatingPointError("the loss is not finite")
    return loss


def train_fsdp(
    per_rank: int,
    k: int,
    budget_mib: float | None,
    auto: bool = True,
    ckpt: str | None = None,
    reads: bool = False,
) -> dict:
    """fit under FSDP with `per_rank` samples per loader micro-batch, accumulation k and the step budget
    `budget_mib` (None: unset); the full weights after it, the split and the estimate. `reads`: the
    train_step calls `.item()` (its estimate fails), and the session's lines are returned."""
    old = os.environ.pop(STEP_MEMORY_ENV, None)
    if budget_mib is not None:
        os.environ[STEP_MEMORY_ENV] = f"{budget_mib:.3f}"
    rec = Recorder()
    out = io.StringIO()
    try:
        with (
            contextlib.redirect_stdout(out),
            ddpkit.session(
                seed=0,
                accumulation=k,
                strategy="fsdp",
                verbose=reads,
                log_to=rec,
                micro_batch="auto" if auto else None,
            ) as s,
        ):
            model = s.model(_mlp)
            opt = torch.optim.AdamW(model.parameters(), lr=0.01)
            loader = s.loader(_dataset(), batch_size=per_rank * s.world_size * k, shuffle=True)
            result = ddpkit.fit(
                s,
                model,
                opt,
                loader,
                _loss_read if reads else _loss,
                max_steps=STEPS,
                progress=False,
                flops=None,
            )
            if ckpt is not None:
                s.save(ckpt, model=model, optimizer=opt, stepper=s.stepper)
            auto_state = s.stepper.oom
            return {
                "params": [p.full_tensor().detach().clone() for p in ddpkit.unwrap(model).parameters()],
                "steps": result.steps,
                "parts": auto_state.parts if auto_state else None,
                "accumulation": s.stepper.blocks,
                "estimate": dict(auto_state.estimate) if auto_state else None,
                "splits": list(auto_state.splits) if auto_state else None,
                "logged": [v for _, v in rec.seen if "micro_batch/parts" in v],
                "said": [line for line in out.getvalue().splitlines() if "micro_batch='auto'" in line],
                "note": auto_state.ahead_note if auto_state else "",
            }
    finally:
        os.environ.pop(STEP_MEMORY_ENV, None)
        if old is not None:
            os.environ[STEP_MEMORY_ENV] = old


def resume_fsdp(ckpt: str, budget_mib: float) -> dict:
    """A new session loads the checkpoint (with a budget that would not split) and trains one step."""
    os.environ[STEP_MEMORY_ENV] = f"{budget_mib:.3f}"
    try:
        with ddpkit.session(
            seed=0, accumulation=1, strategy="fsdp", verbose=False, log_to=None, micro_batch="auto"
        ) as s:
            model = s.model(_mlp)
            opt = torch.optim.AdamW(model.parameters(), lr=0.01)
            s.load(ckpt, model=model, optimizer=opt, stepper=s.stepper)
            loaded = (s.stepper.oom.parts, s.stepper.blocks)
            loader = s.loader(_dataset(), batch_size=PER_RANK * s.world_size)
            ddpkit.fit(s, model, opt, loader, _loss, max_steps=STEPS + 1, progress=False, flops=None)
            return {"loaded": loaded, "parts": s.stepper.oom.parts, "estimate": dict(s.stepper.oom.estimate)}
    finally:
        os.environ.pop(STEP_MEMORY_ENV, None)


def _diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def generous(pool2) -> list[dict]:
    """The run with a budget far above the step (1 GiB): the estimate made once, nothing split."""
    return pool2.run(train_fsdp, PER_RANK, 1, 1024.0, timeout=120)


def test_a_generous_budget_splits_nothing(generous, pool2) -> None:
    """(b) parts 1, accumulation unchanged, the estimate's figures kept (its peak far under the budget,
    paid once: its seconds stated) and logged once; the steps run as without the opt-in (FSDP's own
    reduce-scatter, no agreement per block): the weights are those of plain FSDP."""
    plain = pool2.run(train_fsdp, PER_RANK, 1, None, False, timeout=120)
    for r in generous:
        assert r["parts"] == 1 and r["accumulation"] == 1 and r["splits"] == [], r
        e = r["estimate"]
        assert e["parts"] == 1 and 0 < e["whole"] < e["budget"] == 1024 << 20, e
        print(f"estimate: whole step {e['whole'] / 2**20:.2f} MiB, {e['seconds']:.2f} s once per run")
    logged = generous[0]["logged"]
    assert len(logged) == 1 and logged[0]["micro_batch/parts"] == 1 and logged[0]["memory/budget_mib"] == 1024
    diff = _diff(generous[0]["params"], plain[0]["params"])
    print(f"micro_batch='auto' under FSDP with no split vs plain FSDP: max |diff| {diff:.2e}")
    assert diff < FLOOR


@pytest.mark.numerics
def test_a_small_budget_splits_ahead_and_equals_the_smaller_loader_batch(generous, pool2, tmp_path: Path):
    """(a) 80 % of the estimated whole step: the first step is split in 2 on both ranks before it runs,
    and the weights equal those of a run whose loader gave micro-batches of 128 with accumulation 2.
    (c) the checkpoint carries the split and its estimate: a resumed session starts at 2 parts and does
    not estimate again (its generous budget would have chosen 1)."""
    whole = max(r["estimate"]["whole"] for r in generous) / 2**20
    ckpt = str(tmp_path / "ckpt")
    got = pool2.run(train_fsdp, PER_RANK, 1, 0.8 * whole, True, ckpt, timeout=120)
    ref = pool2.run(train_fsdp, PER_RANK // 2, 2, None, False, timeout=120)
    for r in got:
        assert r["steps"] == STEPS and r["parts"] == 2 and r["accumulation"] == 2, r["estimate"]
        assert r["splits"] == [{"step": 1, "parts": 2}]
        e = r["estimate"]
        assert e["micro_batch"] == PER_RANK / 2 and e["peak"] * 1.1 <= e["budget"] < e["whole"] * 1.1, e
    logged = got[0]["logged"]  # rank 0 logs to the trackers, once
    assert [(v["micro_batch/size"], v["micro_batch/parts"]) for v in logged] == [(PER_RANK / 2, 2)], logged
    diff = _diff(got[0]["params"], ref[0]["params"])
    print(f"split ahead (2 x 128) vs loader micro-batch 128 with accumulation 2: max |diff| {diff:.2e}")
    assert diff < FLOOR, f"the split changed the training by {diff:.2e}"
    resumed = pool2.run(resume_fsdp, ckpt, 1024.0, timeout=120)
    for r in resumed:
        assert r["loaded"] == (2, 2) and r["parts"] == 2, r
        assert r["estimate"]["budget"] == got[0]["estimate"]["budget"], "estimated again after the resume"


def test_an_estimate_that_fails_trains_unsplit_and_says_why_and_how(generous, pool2) -> None:
    """A train_step fake tensors cannot run (`.item()` on the loss: a NaN guard) under a budget that
    would split: the run neither crashes nor splits silently: 1 part on both ranks, one line on rank 0
    naming the fake-tensor error and the hand split (accumulation=2 for micro-batches of 128), and the
    weights of plain FSDP (the generous run's, checked equal to plain FSDP above)."""
    whole = max(r["estimate"]["whole"] for r in generous) / 2**20
    got = pool2.run(train_fsdp, PER_RANK, 1, 0.8 * whole, True, None, True, timeout=120)
    for r in got:
        assert r["steps"] == STEPS and r["parts"] == 1 and r["accumulation"] == 1 and r["splits"] == [], r
        assert r["estimate"]["failed"] == 2 and r["estimate"]["peak"] == 0, r["estimate"]
        note = r["note"]
        assert "the estimate before the first step failed (DataDependentOutputException" in note, note
    said = got[0]["said"]
    print(said[0] if said else "nothing said")
    assert len(said) == 1 and got[1]["said"] == [], (said, got[1]["said"])
    assert "could not be estimated on fake tensors (DataDependentOutputException" in said[0], said
    assert ".item()" in said[0] and "no split, micro-batches of 256" in said[0], said
    assert "accumulation=2 (micro-batches of 128 for the same global batch 512)" in said[0], said
    assert [(v["micro_batch/size"], v["micro_batch/parts"]) for v in got[0]["logged"]] == [(PER_RANK, 1)]
    diff = _diff(got[0]["params"], generous[0]["params"])
    assert diff < FLOOR, f"a failed estimate changed the training by {diff:.2e}"


def test_the_failed_estimate_is_named_in_the_users_terms() -> None:
    """What fake tensors cannot run, as the one line says it: a value read, a shape from the data."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ddpkit.training import oom_ahead

    said = {}
    for name, step in {"read": lambda x: x.sum().item(), "mask": lambda x: x[x > 0]}.items():
        with FakeTensorMode() as mode:
            x = mode.from_tensor(torch.randn(4, 3))
            with pytest.raises(RuntimeError) as err:
                step(x)
        said[name] = oom_ahead.failure(err.value)
    assert said["read"].startswith("DataDependentOutputException: aten._local_scalar_dense"), said
    assert "reads a tensor's value (.item()" in said["read"], said
    assert said["mask"].startswith("DynamicOutputShapeException: aten.nonzero"), said
    assert "makes a shape from the data (a boolean mask" in said["mask"], said
    assert "\n" not in oom_ahead.failure(ValueError("first line\n  second line")), "not one line"


def test_a_real_oom_under_fsdp_says_the_estimate_it_split_by() -> None:
    """Under FSDP no agreement can follow a rank out of its collectives: an out-of-memory error in a step
    stays the one-paragraph error (the launcher ends the peers), now with the estimate that was wrong."""
    from ddpkit.errors import DdpkitError
    from ddpkit.step import oom
    from ddpkit.training import oom_ahead

    auto = oom.AutoMicroBatch(rank=0, world=2, distributed=False, device=torch.device("cpu"))
    auto.ahead = True
    auto.parts = 2
    auto.estimate = {"micro_batch": 64.0, "peak": 300.0 * 2**20, "budget": 400.0 * 2**20, "parts": 2.0}
    auto.ahead_note = oom_ahead.note(auto.estimate)  # as `oom_ahead.choose` sets it
    with pytest.raises(DdpkitError) as err, oom.guarded(auto), oom.naming(64, 0, auto):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    text = str(err.value)
    assert "rank 0 ran out of memory" in text and "micro-batch 64" in text, text
    assert "estimated this rank's peak at 300 MiB for micro-batch 64 against a budget of 400 MiB" in text, (
        text
    )
