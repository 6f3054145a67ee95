"""Rank functions for tests/test_activation_checkpointing.py (run in the shared rank pools)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from fsdp_train import Block, data, full_params, net

import ddpkit
from ddpkit.strategy import FSDPOptions
from ddpkit.strategy.checkpointing import plain_name


class DropBlock(Block):
    """A Block with dropout inside: its recompute in the backward must draw the forward's mask."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.dropout(torch.tanh(self.lin(x)), p=0.5, training=self.training)


def dropnet() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), *[DropBlock(16) for _ in range(3)], torch.nn.Linear(16, 4)
    )


def _final(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {plain_name(n): t for n, t in full_params(model).items()}  # the names state_dict uses


def train(strategy: str, recompute: bool, steps: int = 3, cls: type = Block, dropout: bool = False) -> dict:
    """The README loop on the Block net; with `activation_checkpointing=Block` or without. Returns the
    final weights, how often each Block's forward ran (twice per step when recomputed), the FSDP units.
    `dropout`: the blocks are DropBlocks (dropout p=0.5 inside each)."""
    with ddpkit.session(seed=0, verbose=False) as s:
        chosen = FSDPOptions(blocks=(Block,)) if strategy == "fsdp" else strategy
        model = s.model(
            dropnet if dropout else net, strategy=chosen, activation_checkpointing=cls if recompute else None
        )
        inner = ddpkit.unwrap(model)
        calls = [0]
        for m in inner.modules():
            if isinstance(m, Block):  # FSDP2 makes it an FSDPBlock
                m.register_forward_pre_hook(
                    lambda *_: calls.__setitem__(0, calls[0] + 1)
                )  # pre: the recompute
                # stops early once it has what the backward needs, before a post-forward hook
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for x, y in list(s.loader(data(), batch_size=16))[:steps]:
            with s.accumulate(model):
                s.backward(F.cross_entropy(model(x), y))
            s.step(opt)
        units = sorted(n for n, m in inner.named_modules() if type(m).__name__.startswith("FSDP"))
        return {
            "final": _final(model),
            "calls": calls[0],
            "units": units,
            "state_keys": sorted(inner.state_dict().keys()),
        }


def hf_auto(strategy: str, recompute: bool, weights: str | None = None) -> dict:
    """GPT-2 with activation_checkpointing="auto" (its _no_split_modules: GPT2Block), 2 steps."""
    import hf_ranks

    with ddpkit.session(seed=0, verbose=False) as s:
        chosen = FSDPOptions(min_block_params=10_000) if strategy == "fsdp" else strategy
        model = s.model(
            hf_ranks.factory("gpt2"),
            strategy=chosen,
            weights=weights,
            activation_checkpointing="auto" if recompute else None,
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

        wrapped = sum(isinstance(m, CheckpointWrapper) for m in ddpkit.unwrap(model).modules())
        for step in range(2):
            batch = hf_ranks._rows(hf_ranks.padded(step, rows=8), s.rank, s.world_size)
            with s.accumulate(model):
                out = model(
                    input_ids=batch["input_ids"],
                    attention_mask=batch["attention_mask"],
                    labels=batch["labels"],
                    use_cache=False,
                )
                s.backward(out.loss)
            s.step(opt)
        return {"final": _final(model), "wrapped": wrapped}
