"""DDP on 4 ranks equals one process: Linear(10, 10), 20 samples, MSE, one SGD step with lr 1.

    python examples/linear_equivalence.py          # 4 gloo ranks on this machine, then the report
    ddpkit verify -- --model examples.linear_equivalence:model --batches examples.linear_equivalence:batch \\
        --loss mse --optimizer sgd --lr 1 --nproc 4 --steps 1 --batch-size 20

The course's set-up: `torch.manual_seed(123)`, then the model, then 20x10 inputs and 20x10 targets.
One process trains on all 20 rows; with DDP, rank r trains on rows 5r..5r+4 and the all-reduce averages
the four gradients. Each gradient is a mean over its rows, so the average of four means of 5 is the
mean of 20: the same step, up to the order in which the floating-point sums are taken.
"""

from __future__ import annotations

import torch
from torch import nn

from ddpkit.verify import Report, VerifySpec, verify


def course_setup() -> tuple[nn.Linear, torch.Tensor, torch.Tensor]:
    """The model and the data, drawn in this order from one generator seeded with 123."""
    torch.manual_seed(123)
    linear = nn.Linear(10, 10)
    inputs = torch.randn(20, 10)
    targets = torch.randn(20, 10)
    return linear, inputs, targets


def model() -> nn.Linear:
    return course_setup()[0]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of every step: all 20 rows (the checker gives rank r rows 5r..5r+4)."""
    _, inputs, targets = course_setup()
    return inputs, targets


def spec(nproc: int = 4) -> VerifySpec:
    return VerifySpec(
        model=model,
        batches=batch,
        loss="mse",
        optimizer="sgd",
        optimizer_options={"lr": 1.0},
        nproc=nproc,
        steps=1,
        batch_size=20,
    )


def main() -> Report:
    report = verify(spec())
    print(report.render())
    w = next(r for r in report.tensors if r.name == "weight")
    print(f"\nDDP weight vs one process: max abs diff {w.max_abs_diff:.3g}, relative norm {w.rel_norm:.3g}")
    return report


if __name__ == "__main__":
    raise SystemExit(0 if main().passed else 1)
