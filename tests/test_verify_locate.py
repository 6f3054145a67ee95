"""`locate`: planted faults in a small transformer stack are found at their step, module and operation.

The model here (token embedding, two pre-norm blocks of hand-written attention and an MLP, a head) is
none of verify's own test models. Every fault is planted so that one process and the 2-rank DDP side
part only where the fault is: a rank-dependent scale, a summed loss, a dropout drawn per rank, a custom
autograd function whose backward is 1 % off once it runs on more than one rank. The candidate runs on
the shared 2-rank gloo pool; every factory is at module level so that the ranks can import it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ddpkit.verify import VerifySpec
from ddpkit.verify.locate import Location, locate

pytestmark = pytest.mark.numerics

VOCAB, WIDTH, LENGTH = 32, 16, 6


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class OffByOnePercentGelu(torch.autograd.Function):
    """GELU whose hand-written backward is 1 % too large on ranks of a job (a 'fused' kernel's bug)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return F.gelu(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        cdf = 0.5 * (1 + torch.erf(x / 2**0.5))
        pdf = torch.exp(-0.5 * x * x) / (2 * torch.pi) ** 0.5
        wrong = 1.01 if dist.is_initialized() and dist.get_world_size() > 1 else 1.0
        return grad * (cdf + x * pdf) * wrong


class Mlp(nn.Module):
    def __init__(self, fault: str = "") -> None:
        super().__init__()
        self.fc1, self.fc2, self.fault = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH), fault

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        h = OffByOnePercentGelu.apply(h) if self.fault == "backward" else F.gelu(h)
        out = self.fc2(h)
        if self.fault == "rank-scale":
            out = out * (1.0 + 0.1 * _rank())
        return out


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        weights = torch.softmax(q @ k.transpose(-1, -2) / WIDTH**0.5, dim=-1)
        return self.proj(weights @ v)


class Block(nn.Module):
    def __init__(self, fault: str = "", dropout: float = 0.0) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(WIDTH), Attention()
        self.norm2, self.mlp = nn.LayerNorm(WIDTH), Mlp(fault)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x)))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, fault: str = "", faulty_block: int = 1, dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(
            Block(fault if i == faulty_block else "", dropout if i == 0 else 0.0) for i in range(2)
        )
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def tiny_lm() -> nn.Module:
    return TinyLM()


def tiny_lm_rank_scale() -> nn.Module:
    return TinyLM("rank-scale")


def tiny_lm_wrong_backward() -> nn.Module:
    return TinyLM("backward")


def tiny_lm_dropout() -> nn.Module:
    return TinyLM(dropout=0.1)


def token_batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (8, LENGTH + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def lm_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    ids, targets = batch
    return F.cross_entropy(model(ids).reshape(-1, VOCAB), targets.reshape(-1))


def summed_lm_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    ids, targets = batch
    return F.cross_entropy(model(ids).reshape(-1, VOCAB), targets.reshape(-1), reduction="sum")


def run(pool, steps: int = 1, **overrides) -> Location:
    spec = VerifySpec(
        **{
            "model": tiny_lm,
            "batches": token_batches,
            "loss": lm_loss,
            "optimizer": "adamw",
            "steps": steps,
            "batch_size": 8,
            **overrides,
        }
    )
    return locate(spec, runner=lambda fn, *args: pool.run(fn, *args, timeout=120))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_no_finding_on_the_correct_model(pool2, precision: str) -> None:
    found = run(pool2, steps=3, precision=precision)
    assert not found.found, found.render()
    assert "no record differs" in found.render()


def test_a_rank_dependent_scale_is_located_in_its_block_forward(pool2) -> None:
    found = run(pool2, model=tiny_lm_rank_scale)
    text = found.render()
    assert found.step == 1 and found.key is not None and found.key.phase == "forward", text
    assert found.window is not None and found.window.module == "blocks.1.mlp", text
    assert found.difference is not None and found.difference.ranks == (1,), text
    assert found.op == "aten.mul.Tensor", text
    assert "blocks.1.mlp (Mlp)" in text and "rank(s) 1 differ" in text


def test_a_summed_loss_is_located_at_the_loss(pool2) -> None:
    found = run(pool2, loss=summed_lm_loss)
    text = found.render()
    assert found.key is not None and (found.key.phase, found.key.module) == ("loss", "(loss)"), text
    assert found.op is not None and "nll_loss" in found.op, text
    assert found.difference is not None and found.difference.rel_norm == pytest.approx(0.5, rel=1e-3), text


def test_a_dropout_drawn_per_rank_is_located_at_the_dropout(pool2) -> None:
    found = run(pool2, model=tiny_lm_dropout)
    text = found.render()
    assert found.window is not None and found.window.module == "blocks.0.drop", text
    assert found.key is not None and found.key.phase == "forward", text
    assert found.difference is not None and found.difference.ranks == (1,), text
    assert found.op is not None and ("bernoulli" in found.op or "dropout" in found.op), text


def test_a_custom_backward_1_percent_off_is_located_in_the_backward(pool2) -> None:
    found = run(pool2, model=tiny_lm_wrong_backward)
    text = found.render()
    assert found.key is not None and found.key.phase == "backward", text
    assert found.window is not None and found.window.module == "blocks.1.mlp", text
    assert found.op == "aten.mul.Tensor", text
    assert "test_verify_locate.py" in found.op_source, text
    assert found.difference is not None and found.difference.rel_norm == pytest.approx(0.01, rel=0.2), text


def test_no_finding_under_fsdp_whose_weights_are_compared_whole(pool2) -> None:
    found = run(pool2, steps=2, strategy="fsdp")
    assert not found.found, found.render()
    assert "fsdp on 2 ranks" in found.config


def test_ddpkit_verify_locate_prints_the_place_and_a_failed_verify_suggests_it(
    pool2, monkeypatch, capsys
) -> None:
    from ddpkit.verify import checker, cli
    from ddpkit.verify import locate as locating

    runner = lambda fn, *args: pool2.run(fn, *args, timeout=120)  # noqa: E731 (the shared ranks)
    monkeypatch.setattr(locating, "locate", lambda spec: locate(spec, runner=runner))
    argv = [
        "--model",
        "test_verify_locate:tiny_lm_rank_scale",
        "--batches",
        "test_verify_locate:token_batches",
    ]
    argv += [
        "--loss",
        "test_verify_locate:lm_loss",
        "--optimizer",
        "adamw",
        "--steps",
        "1",
        "--batch-size",
        "8",
    ]
    assert cli.main([*argv, "--locate"]) == 1
    text = capsys.readouterr().out
    assert "forward of blocks.1.mlp (Mlp)" in text and "aten.mul.Tensor" in text, text
    monkeypatch.setattr(cli, "verify", lambda spec: checker.verify(spec, runner=pool2.run))
    assert cli.main(argv) == 1
    assert "run the same command with --locate" in capsys.readouterr().out
