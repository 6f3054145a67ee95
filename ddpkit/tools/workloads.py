"""The named benchmark workloads (cnn, bn, small, mlp, gpt) and a user's own as `package.module:function`.

One definition shared by `ddpkit bench`, `ddpkit trace` and `benchmarks/*.py`, so every figure in
docs/performance.md measures exactly the same model, optimizer and batch:

| name | model | optimizer | global batch |
|---|---|---|---|
| cnn | the PyTorch CIFAR-10 tutorial CNN (62k parameters), 3x32x32 inputs | SGD lr 1e-3 momentum 0.9 | 64 |
| mlp | 1024→4096→4096→4096→10 with ReLU (37.8M parameters, 151 MB of gradients) | AdamW lr 1e-4 | 64 |
| gpt | 4-layer decoder-only transformer, d_model 256, 4 heads, seq 128, vocab 4096 | AdamW lr 3e-4 | 16 |
| bn | 4 x (conv, BatchNorm, ReLU), 32-64 channels, pool, linear; 3x32x32 (66k parameters) | SGD | 64 |
| small | 48 x (Linear(128, 128), LayerNorm, GELU), 128→10 (0.8M parameters, 194 tensors) | AdamW | 64 |

`bn` has buffers (running statistics) that DDP broadcasts from rank 0 before every forward; `small`
has many tiny tensors, so per-tensor and per-call costs (hooks, bucket views, the optimizer's loop over
parameters) weigh more than the arithmetic: the two shapes where a wrapper's overhead shows first.

Data are synthetic (a fixed pool of random batches from a seeded generator): the benchmarks measure
the training step, not a data set. A user's workload is a function taking no arguments that returns
a `Workload`; `ddpkit bench scaling --workload mypkg.models:my_workload` imports and calls it.
"""

from __future__ import annotations

import importlib
import itertools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from ddpkit.errors import problem

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class Workload:
    """A model, its optimizer, a batch generator and a loss: everything a benchmark step needs.

    `sample(generator, n)` returns n (input, target) samples; `loss(output, target)` reduces with a mean
    over the batch, so DDP's averaged gradients equal one process's on the global batch.
    """

    name: str
    build: Callable[[], nn.Module]
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
    sample: Callable[[torch.Generator, int], Batch]
    global_batch: int
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy

    def __post_init__(self) -> None:
        if self.global_batch < 1:
            raise problem(f"workload {self.name!r} has global_batch={self.global_batch}", "Use 1 or more")

    def dataset(self, batches: int = 4, seed: int = 0) -> TensorDataset:
        """`batches` global batches of synthetic samples, identical on every rank (same seed)."""
        x, y = self.sample(torch.Generator().manual_seed(seed), self.global_batch * batches)
        return TensorDataset(x, y)

    def step_loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        x, y = batch
        out = model(x)
        return self.loss(out.reshape(-1, out.shape[-1]), y.reshape(-1))


# -- cnn: the CIFAR-10 tutorial network -----------------------------------------------------------
class TutorialCNN(nn.Module):
    """The network of PyTorch's "Training a classifier" tutorial, unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def _images(g: torch.Generator, n: int) -> Batch:
    return torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)


# -- mlp: 151 MB of gradients for little compute: communication-bound ----------------------------
def make_mlp(widths: tuple[int, ...] = (1024, 4096, 4096, 4096, 10)) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def _vectors(g: torch.Generator, n: int) -> Batch:
    return torch.randn(n, 1024, generator=g), torch.randint(0, 10, (n,), generator=g)


# -- gpt: a small decoder-only transformer: compute-bound ----------------------------------------
class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x MLP (nanoGPT's layout)."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 4096, seq: int = 128, d: int = 256, heads: int = 4, layers: int = 4):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.Sequential(*(Block(d, heads) for _ in range(layers)))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        for name, p in self.named_parameters():  # GPT-2 initialisation, scaled residual projections
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "mlp.2.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln(self.blocks(self.tok(idx) + self.pos(pos))))


# -- bn: BatchNorm buffers, broadcast by DDP before every forward ---------------------------------
def make_bn_cnn(channels: tuple[int, ...] = (32, 32, 64, 64)) -> nn.Sequential:
    layers: list[nn.Module] = []
    c_in = 3
    for i, c in enumerate(channels):
        layers += [
            nn.Conv2d(c_in, c, 3, stride=2 if i % 2 else 1, padding=1, bias=False),
            nn.BatchNorm2d(c),
            nn.ReLU(),
        ]
        c_in = c
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, 10))


# -- small: many small parameters, so per-tensor costs dominate ----------------------------------
def make_many_small(width: int = 128, blocks: int = 48) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def _features(g: torch.Generator, n: int) -> Batch:
    return torch.randn(n, 128, generator=g), torch.randint(0, 10, (n,), generator=g)


def _tokens(g: torch.Generator, n: int, seq: int = 128, vocab: int = 4096) -> Batch:
    data = torch.randint(0, vocab, (n, seq + 1), generator=g)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


NAMED: dict[str, Workload] = {
    "cnn": Workload(
        name="cnn",
        build=TutorialCNN,
        optimizer=lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9),
        sample=_images,
        global_batch=64,
    ),
    "mlp": Workload(
        name="mlp",
        build=make_mlp,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4),
        sample=_vectors,
        global_batch=64,
    ),
    "gpt": Workload(
        name="gpt",
        build=TinyGPT,
        optimizer=lambda p: torch.optim.AdamW(p, lr=3e-4),
        sample=_tokens,
        global_batch=16,
    ),
    "bn": Workload(
        name="bn",
        build=make_bn_cnn,
        optimizer=lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
        sample=_images,
        global_batch=64,
    ),
    "small": Workload(
        name="small",
        build=make_many_small,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
        sample=_features,
        global_batch=64,
    ),
}


def load(spec: str) -> Workload:
    """A named workload (cnn, bn, small, mlp, gpt) or `package.module:function` returning a `Workload`."""
    if spec in NAMED:
        return NAMED[spec]
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise problem(
            f"workload {spec!r} is neither a named workload nor package.module:function",
            f"Pass one of {sorted(NAMED)}, or e.g. mypkg.models:my_workload (a function returning "
            "ddpkit.tools.workloads.Workload)",
        )
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        fix = "Check the module path and PYTHONPATH"
        raise problem(f"cannot load workload {spec!r}: {err}", fix) from err
    workload = fn()
    if not isinstance(workload, Workload):
        raise problem(
            f"{spec} returned {type(workload).__name__}, not a ddpkit.tools.workloads.Workload",
            "Return Workload(name=..., build=..., optimizer=..., sample=..., global_batch=...)",
        )
    return workload


def parameter_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
