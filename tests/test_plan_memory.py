"""`ddpkit plan --memory`: one step's peak per rank on fake tensors, by category (ddpkit.plan.memory).

The model-state categories of an MLP are checked against bytes computed by hand; activations against
the micro-batch; FSDP against the world size; the CLI as a user runs it; and the estimate against the
peak the kernel measures on two real ranks (tests/test_plan_memory_ranks.py).
"""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch
from torch import nn

from ddpkit.errors import DdpkitError
from ddpkit.observe.memory_breakdown import Breakdown
from ddpkit.plan import devices, memory, memory_cli, memory_fit, memory_models
from ddpkit.plan.memory import MemoryJob

WIDTHS = (64, 256, 128, 16)  # every dimension divisible by 2 and 4: FSDP's shards are exact


@pytest.fixture(autouse=True, scope="module")
def _each_step_estimated_once() -> Iterator[None]:
    """One fake step per distinct job in this module: the tests, the micro-batch search and the CLI ask
    for many of the same (the tiny GPT at 2 ranks, micro-batches 1-16), and a job's estimate is a pure
    function of it (fake tensors; `Breakdown` is frozen), so each is run once and its breakdown shared."""
    shared = functools.cache(memory.estimate)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(memory, "estimate", shared)
        patch.setattr(memory_fit, "estimate", shared)
        yield


def estimate(job: MemoryJob) -> Breakdown:
    return memory.estimate(job)  # the shared one, while this module's tests run


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 16))


def sample(g: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, WIDTHS[0], generator=g), torch.randint(0, WIDTHS[-1], (n,), generator=g)


def _params() -> tuple[int, int]:
    """(parameters, tensors) of the MLP, by hand."""
    count = sum(a * b + b for a, b in itertools.pairwise(WIDTHS))
    return count, 2 * (len(WIDTHS) - 1)


def _job(**kw) -> MemoryJob:
    return MemoryJob(
        **{"model": mlp, "sample": sample, "micro_batch": 8, "world": 2, "device_kind": "cpu", **kw}
    )


def test_model_state_of_an_mlp_matches_the_bytes_computed_by_hand() -> None:
    count, tensors = _params()
    b = estimate(_job())
    assert b.parameters == 4 * count  # fp32 weights and biases
    assert b.gradients == 4 * count  # DDP's buckets hold every gradient through the step
    assert b.optimizer_state == 2 * 4 * count + 4 * tensors  # AdamW: exp_avg, exp_avg_sq, a float32 step each
    sgd = estimate(_job(optimizer="sgd"))
    assert sgd.optimizer_state == 4 * count  # SGD with momentum: one buffer per parameter
    assert b.activations > 0 and b.peak == sum(n for _, n in b.rows())


def test_fsdp_and_the_sharded_step_divide_model_state_by_the_world_size() -> None:
    count, tensors = _params()
    for world in (2, 4):
        f = estimate(_job(strategy="fsdp", world=world))
        assert f.parameters == 4 * count // world
        assert f.optimizer_state == 2 * 4 * count // world + 4 * tensors
        assert f.fsdp_buffers > 0  # a unit's whole parameters, gathered for its forward and backward
    two, four = estimate(_job(strategy="fsdp", world=2)), estimate(_job(strategy="fsdp", world=4))
    assert two.parameters == 2 * four.parameters
    hsdp = estimate(_job(strategy="hsdp", world=4, shard_degree=2))  # 2 replicas of 2 shards
    assert hsdp.parameters == two.parameters and hsdp.optimizer_state == two.optimizer_state
    # FSDP2's HSDP all-reduces the reduce-scatter's output in place, and that output is the sharded
    # gradient (fp32 reduce): the whole step, run through that all-reduce on the 2-D mesh, holds to the
    # byte what FSDP over the shard group holds, which is how micro_batch="auto" estimates HSDP
    assert hsdp.as_dict() == two.as_dict(), (hsdp.as_dict(), two.as_dict())
    zero1 = estimate(_job(strategy="zero1", world=2))
    assert zero1.parameters == 4 * count and zero1.gradients == 4 * count  # replicated, as DDP
    # rank 0 owns the largest tensor (256x128) and, greedily, what keeps the ranks' loads level
    assert 0 < zero1.optimizer_state < estimate(_job()).optimizer_state


def test_activations_grow_with_the_micro_batch_and_checkpointing_cuts_them() -> None:
    small, big = (estimate(MemoryJob(model="gpt", micro_batch=m, world=2, device_kind="cpu")) for m in (2, 4))
    assert small.model_state == big.model_state
    assert big.activations == pytest.approx(2 * small.activations, rel=0.05)
    assert big.temporaries == pytest.approx(2 * small.temporaries, rel=0.05)
    ac = estimate(
        MemoryJob(model="gpt", micro_batch=4, world=2, device_kind="cpu", activation_checkpointing="Block")
    )
    assert ac.activations < 0.5 * big.activations
    assert ac.model_state == big.model_state


def test_bf16_and_a_hugging_face_model_from_its_config() -> None:
    pytest.importorskip("transformers")
    spec = "hf:gpt2,n_layer=2,n_embd=128,n_head=2,n_positions=128,vocab_size=256"
    fp32 = estimate(MemoryJob(model=spec, micro_batch=8, seq_len=128, world=2))
    bf16 = estimate(MemoryJob(model=spec, micro_batch=8, seq_len=128, world=2, precision="bf16"))
    assert bf16.parameters == fp32.parameters  # autocast keeps fp32 weights
    assert bf16.activations < fp32.activations
    fsdp = estimate(
        MemoryJob(
            model=spec, micro_batch=8, seq_len=128, world=2, strategy="fsdp", activation_checkpointing="auto"
        )
    )
    assert fsdp.parameters < fp32.parameters
    assert memory_models.parameter_count(memory_models.resolve(spec)) == sum(
        p.numel() for p in _hf_model(spec).parameters()
    )


def _hf_model(spec: str) -> nn.Module:
    return memory.resolve_model(MemoryJob(model=spec, micro_batch=1)).build()


def test_the_largest_micro_batch_that_fits_keeps_the_global_batch() -> None:
    job = MemoryJob(model="gpt", micro_batch=8, world=2, device_kind="cpu")
    one, eight = estimate(replace(job, micro_batch=1)), estimate(job)
    capacity = (one.peak + eight.peak) // 2  # between the two: some micro-batch in 1..8 fits, 8 does not
    fit, _ = memory_fit.largest_fit(job, 16, capacity, allowance=0.0, reserved=0)
    assert fit is not None and fit.micro_batch * fit.accumulation * 2 == 16
    assert fit.breakdown.total <= capacity
    bigger = [m for m, _ in memory_fit.splits(16, 2) if m > fit.micro_batch]
    assert all(estimate(replace(job, micro_batch=m)).peak > capacity for m in bigger)
    none, _ = memory_fit.largest_fit(job, 16, one.peak // 2, allowance=0.0, reserved=0)
    assert none is None


def test_cli_prints_the_breakdown_the_fit_and_what_to_change(capsys) -> None:
    from ddpkit.plan import cli

    assert (
        cli.main(
            [
                "--memory",
                "--model",
                "gpt",
                "--device",
                "cpu",
                "--device-memory",
                "0.7",
                "--world",
                "2",
                "--global-batch",
                "32",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    for row in ("parameters", "gradients", "optimizer state", "activations", "allocator allowance", "total"):
        assert row in out
    assert "largest micro-batch that fits: " in out and "accumulation" in out
    assert (
        cli.main(
            [
                "--memory",
                "--model",
                "gpt",
                "--device-memory",
                "0.05",
                "--world",
                "2",
                "--global-batch",
                "4",
                "--json",
                "-",
            ]
        )
        == 0
    )
    plan = json.loads(capsys.readouterr().out)
    assert plan["largest_fit"] is None
    assert plan["alternatives"][0]["job"].startswith("FSDP2")
    assert cli.main(["--memory", "--model", "gpt", "--world", "3", "--global-batch", "4"]) == 2
    assert "does not split evenly over 3 ranks" in capsys.readouterr().err


def test_devices_and_bad_input() -> None:
    h100 = devices.named("H100")
    assert h100.memory == 81559 << 20 and h100.reserved > 0 and 0 < h100.allowance < 0.5
    assert devices.named("cpu", world=4).kind == "cpu"
    with pytest.raises(DdpkitError, match="not known"):
        devices.named("tpu")
    with pytest.raises(DdpkitError, match="fp16 with FSDP"):
        MemoryJob(model="gpt", micro_batch=1, strategy="fsdp", precision="fp16")
    with pytest.raises(DdpkitError, match="--sample"):
        estimate(MemoryJob(model=mlp, micro_batch=1))
    with pytest.raises(DdpkitError, match="shard degree"):
        MemoryJob(model="gpt", micro_batch=1, strategy="hsdp", world=8, shard_degree=3)


def test_breakdown_folds_torchs_categories_and_renders_one_screen() -> None:
    b = Breakdown.from_snapshot(
        {
            "cpu": {
                "Parameter": 10,
                "Sharded Grad": 5,
                "Optstate": 20,
                "Activation": 40,
                "Inputs": 2,
                "All Gather": 8,
                "Temp": 4,
                "Total": 89,
            }
        }
    )
    assert (b.parameters, b.gradients, b.optimizer_state, b.activations, b.fsdp_buffers, b.temporaries) == (
        10,
        5,
        20,
        42,
        8,
        4,
    )
    shown = b.with_device(0.5, 100)
    assert shown.allowance == 44 and shown.total == 89 + 44 + 100
    text = shown.text(capacity=200)
    assert "does NOT fit" in text and len(text.splitlines()) < 20
    with pytest.raises(ValueError, match="unknown tracker category"):
        Breakdown.from_snapshot({"cpu": {"Mystery": 1}})
    assert memory_cli.build_parser().parse_args(["--model", "gpt"]).device == "h100"


def test_a_live_step_tracked_on_demand_gives_the_plans_breakdown() -> None:
    """`memory_live.track_step` around one real step of the MLP (gradients kept between steps, as
    DDP's buckets keep them; the optimizer's state made by a first step) gives the estimate's figures:
    same tracker, same fold, real tensors instead of fake ones."""
    from ddpkit.plan.memory_live import track_step

    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        with track_step(model, opt) as step:
            x, y = sample(g, 8)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            del x, y
    live, planned = step.breakdown, estimate(_job(world=1))
    assert live is not None
    count, _ = _params()
    assert (live.parameters, live.gradients) == (4 * count, 4 * count)
    for category in ("parameters", "gradients", "optimizer_state", "activations", "temporaries"):
        want = pytest.approx(getattr(planned, category), rel=0.02, abs=4096)
        assert getattr(live, category) == want, (category, live, planned)
