"""Precision has one owner (`ddpkit.parallel.precision`): what was asked, what the device offers, and what a
strategy can apply are compared in one place. A GPU without bf16 is simulated through the pure
resolution function's `bf16_supported` parameter; FSDP's constructor runs no collective, so the
strategy is built on a plain description of two ranks."""

import pytest
import torch

import ddpkit
from ddpkit import strategy as strategies
from ddpkit.parallel.precision import PrecisionPlan, resolve_precision
from ddpkit.parallel.shape import Shape

TWO_RANKS = Shape(torch.device("cpu"), world_size=2, local_world_size=2)  # the cluster's shape, as a value


def test_bf16_on_a_gpu_without_bf16_under_fsdp_says_what_was_asked_what_the_gpu_offers_and_what_to_pass():
    plan = resolve_precision("bf16", "cuda", bf16_supported=False)  # what the session resolves there
    assert plan.name == "16" and plan.note  # DDP: fp16 with a loss scale, said once
    with pytest.raises(ddpkit.DdpkitError) as err:
        strategies.make("fsdp", TWO_RANKS, precision=plan)
    text = str(err.value)
    assert "precision='bf16'" in text  # what the user asked, not the fallback
    assert "offers '32', '16'" in text
    assert "Pass precision='32'" in text
    assert "precision='bf16' (" not in text and "Pass precision='bf16'" not in text  # not what failed


def test_fp16_under_fsdp_on_a_gpu_with_bf16_points_to_bf16():
    plan = resolve_precision("16", "cuda", bf16_supported=True)
    with pytest.raises(ddpkit.DdpkitError, match=r"Pass precision='bf16' or '32'"):
        strategies.make("fsdp", TWO_RANKS, precision=plan)


def test_ddp_keeps_the_fp16_fallback_and_fsdp_takes_bf16():
    fallback = resolve_precision("bf16", "cuda", bf16_supported=False)
    assert strategies.make("ddp", TWO_RANKS, precision=fallback).name == "ddp"
    fsdp = strategies.make("fsdp", TWO_RANKS, precision=resolve_precision("bf16", "cpu"))
    policy = fsdp.precision.fsdp_policy()
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32


def test_one_plan_gives_the_forward_context_the_scaler_and_the_offer():
    from ddpkit.parallel.precision import offers

    assert offers("cpu") == ("32", "bf16") and offers("cuda", bf16_supported=False) == ("32", "16")
    bf16 = PrecisionPlan("bf16", "cpu")
    with bf16.forward_context():
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16 and torch.is_autocast_enabled("cpu")
    assert bf16.make_scaler() is None and PrecisionPlan("16", "cpu").make_scaler() is not None
    with PrecisionPlan("32", "cpu").forward_context():
        assert not torch.is_autocast_enabled("cpu")
