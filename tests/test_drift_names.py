"""A drift report names the tensor as the user's model spells it, and stops every rank, under DDP and HSDP.

Real gloo ranks train a model of nested blocks (`blocks.1.mlp.weight`) with `session(fingerprint_every=1)`;
one rank flips one bit at step 2. The report must name the parameter (or the optimizer state key) by its
path in the user's model, in a loop with `s.accumulate` and in one without it (where the stepper sees only
the optimizer), and under HSDP (2 replicas x 2 shards) every rank must stop at the same step, though
only one replica group drifted (the other group's ranks would otherwise wait in their next collective).
"""

from __future__ import annotations

import torch
from torch import nn

import ddpkit
from ddpkit.step.fingerprint import ReplicaDrift, parameter_names


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.mlp(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _flip(t: torch.Tensor) -> None:
    """One bit of one element of this rank's copy (its shard under HSDP)."""
    local = t.to_local() if hasattr(t, "to_local") else t.data
    local.view(-1).view(torch.int32)[0] ^= 1 << 4


def _drift(strategy: str, accumulate: bool, what: str) -> dict:
    """Four steps; after step 2 rank 1 flips a bit of `blocks.1.mlp.weight` (or of its AdamW exp_avg)."""
    from ddpkit.strategy.hsdp_options import HSDPOptions

    with ddpkit.session(seed=0, verbose=False, log_to=None, fingerprint_every=1) as s:
        chosen = HSDPOptions(replicate=2, shard=2) if strategy == "hsdp" else strategy
        model = s.model(Net, strategy=chosen)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(s.rank))
        out: dict = {"stopped": None, "message": "", "ranks": None}
        try:
            for step in range(1, 5):
                if accumulate:
                    with s.accumulate(model):
                        s.backward(model(x).square().mean())
                else:  # no s.accumulate: the stepper sees the optimizer only
                    s.backward(model(x).square().mean())
                s.step(opt)
                if step == 2 and s.rank == 1:
                    weight = ddpkit.unwrap(model).blocks[1].mlp.weight
                    _flip(weight if what == "weight" else opt.state[weight]["exp_avg"])
        except ReplicaDrift as drift:
            out.update(stopped=step, message=str(drift), ranks=drift.ranks, last=drift.last_agreed)
        return out


def test_ddp_names_the_parameter_with_and_without_accumulate_and_the_optimizer_state_key(pool2) -> None:
    for accumulate in (True, False):
        results = pool2.run(_drift, "ddp", accumulate, "weight", timeout=120)
        assert [r["stopped"] for r in results] == [3, 3], results
        message = results[0]["message"]
        assert "the first tensor that differs is blocks.1.mlp.weight " in message, message
        assert "group0" not in message and results[1]["message"] == message
        assert results[0]["last"] == 2
    state = pool2.run(_drift, "ddp", True, "exp_avg", timeout=120)
    assert [r["stopped"] for r in state] == [3, 3], state
    assert "first tensor that differs is optimizer state blocks.1.mlp.weight.exp_avg " in state[0]["message"]


def test_hsdp_stops_every_rank_at_the_same_step_and_names_the_shard_group(pool4) -> None:
    results = pool4.run(_drift, "hsdp", True, "weight", timeout=180)
    assert [r["stopped"] for r in results] == [3, 3, 3, 3], results  # ranks 0 and 2 too, not only 1, 3
    message = results[0]["message"]
    assert all(r["message"] == message for r in results)
    assert "the first tensor that differs is blocks.1.mlp.weight " in message, message
    assert "1 of 2 replica groups differ; the first is that of ranks [1, 3]" in message, message
    assert "ranks {1} and ranks {3}" in message, message


def test_names_are_found_for_an_optimizer_alone() -> None:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    names = parameter_names(opt)
    assert names[id(model.blocks[1].mlp.weight)] == "blocks.1.mlp.weight"
    wrapped = nn.Sequential(model)  # a wrapper holds them too, with a prefix: the innermost wins
    assert parameter_names(opt)[id(model.head.bias)] == "head.bias" and wrapped is not None
    named = torch.optim.SGD(model.named_parameters(), lr=0.1)  # names given to the optimizer
    assert parameter_names(named)[id(model.head.weight)] == "head.weight"
