"""The PyTorch CIFAR-10 tutorial's CNN with DDP: 20 SGD steps (momentum 0.9) equal one process's.

    python examples/cifar_cnn.py                   # 2 gloo ranks on this machine vs one process
    ddpkit verify -- --model examples.cifar_cnn:Net --data examples.cifar_cnn:cifar_like \\
        --optimizer sgd --lr 0.001 --momentum 0.9 --steps 20 --batch-size 32

The data are in memory and CIFAR-shaped (3x32x32 images, 10 classes, normalised to [-1, 1] as in
the tutorial), so the example needs no download. The checker reads them as a training script would:
`s.loader(..., batch_size=32, shuffle=True)`, a DistributedSampler that gives each of the 2 ranks 16
different images per step, drawn from the same shuffled order as the single process's batch of 32.
"""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from ddpkit.tools.workloads import TutorialCNN
from ddpkit.verify import Report, VerifySpec, verify

# The tutorial's network: conv 3->6 (5x5), pool, conv 6->16 (5x5), pool, fc 400->120->84->10,
# shared with the benchmarks' "cnn" workload so both measure the same model.
Net = TutorialCNN


def cifar_like(n: int = 1024, seed: int = 0) -> TensorDataset:
    """`n` CIFAR-shaped images whose class shows in the mean colour, so the net has something to learn."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    palette = torch.rand(10, 3, 1, 1, generator=g)
    images = palette[labels] + 0.3 * torch.randn(n, 3, 32, 32, generator=g)
    return TensorDataset((images.clamp(0, 1) - 0.5) / 0.5, labels)


def spec(steps: int = 20) -> VerifySpec:
    return VerifySpec(
        model=Net,
        data=cifar_like,
        loss="cross_entropy",
        optimizer="sgd",
        optimizer_options={"lr": 0.001, "momentum": 0.9},
        nproc=2,
        steps=steps,
        batch_size=32,
    )


def main() -> Report:
    report = verify(spec())
    print(report.render())
    return report


if __name__ == "__main__":
    raise SystemExit(0 if main().passed else 1)
