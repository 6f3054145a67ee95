"""What DDP does in backward, by hand: average the replicas' gradients with one all-reduce.

    python examples/manual_allreduce.py                         # starts its own 2 gloo ranks
    ddpkit run --nproc 2 examples/manual_allreduce.py           # or any launcher (torchrun, srun)

Two replicas of Linear(10, 1, bias=False), every weight 1.0, SGD with lr 0.1, loss (pred - target)^2:

    replica 0: input ten 1.0s, target 100 -> pred 10, grad 2 * (10 - 100) * 1 = -180 per weight
    replica 1: input ten 2.0s, target 200 -> pred 20, grad 2 * (20 - 200) * 2 = -720 per weight
    all-reduce (sum) / world size       -> (-180 + -720) / 2 = -450 on both replicas
    SGD step                            -> 1.0 - 0.1 * (-450) = 46.0 on both replicas

Then the same with real DDP (`s.model`), which does that all-reduce during `loss.backward()`, and with
one process on both samples and the loss averaged over them: all three give 46.0.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

import ddpkit


def replica_data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica `rank`'s one sample: ten (rank + 1)s, target 100 * (rank + 1)."""
    return torch.full((1, 10), float(rank + 1)), torch.full((1, 1), 100.0 * (rank + 1))


def ones_model() -> nn.Linear:
    model = nn.Linear(10, 1, bias=False)
    nn.init.ones_(model.weight)
    return model


def by_hand() -> dict[str, float]:
    """One step on this rank, the gradients averaged with an explicit all_reduce (no DDP)."""
    with ddpkit.session(verbose=False) as s:
        model = ones_model()  # not wrapped: we synchronise by hand
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, target = replica_data(s.rank)
        loss = ((model(x) - target) ** 2).sum()
        loss.backward()
        local = model.weight.grad[0, 0].item()
        dist.all_reduce(model.weight.grad, op=dist.ReduceOp.SUM)  # every rank now holds the sum
        model.weight.grad /= s.world_size  # ... and the mean
        opt.step()
        return {"local_grad": local, "averaged_grad": model.weight.grad[0, 0].item(), **_weights(model)}


def with_ddp() -> dict[str, float]:
    """The same step with DDP: backward all-reduces the gradient bucket for us."""
    with ddpkit.session(verbose=False) as s:
        model = s.model(ones_model())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, target = replica_data(s.rank)
        loss = ((model(x) - target) ** 2).sum()  # ddpkit: noqa: DDP003 (summed on purpose, see the docstring)
        loss.backward()
        grad = ddpkit.unwrap(model).weight.grad[0, 0].item()
        opt.step()
        return {"averaged_grad": grad, **_weights(ddpkit.unwrap(model))}


def one_process() -> dict[str, float]:
    """No replicas: both samples in one batch, the loss averaged over the batch."""
    model = ones_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    (x0, t0), (x1, t1) = replica_data(0), replica_data(1)
    loss = ((model(torch.cat([x0, x1])) - torch.cat([t0, t1])) ** 2).mean()
    loss.backward()
    grad = model.weight.grad[0, 0].item()
    opt.step()
    return {"averaged_grad": grad, **_weights(model)}


def _weights(model: nn.Module) -> dict[str, float]:
    w = model.weight.detach()
    return {"weight": w[0, 0].item(), "weights_all_equal": float(bool((w == w[0, 0]).all()))}


def main() -> None:
    if "RANK" in os.environ:  # started by a launcher: this process is one rank
        hand, ddp = by_hand(), with_ddp()
        print(f"rank {os.environ['RANK']}: by hand {hand}, DDP {ddp}", flush=True)
        return
    hand = ddpkit.spawn(by_hand, nproc=2)
    ddp = ddpkit.spawn(with_ddp, nproc=2)
    single = one_process()
    for rank, result in enumerate(hand):
        print(f"replica {rank}: local gradient {result['local_grad']:g}")
    print(f"after the all-reduce, both replicas: gradient {hand[0]['averaged_grad']:g}")
    print(f"weights after one SGD step (lr 0.1): {[r['weight'] for r in hand]} (by hand)")
    print(f"                                     {[r['weight'] for r in ddp]} (DDP)")
    print(f"                                     {single['weight']} (one process, mean loss)")


if __name__ == "__main__":
    main()
