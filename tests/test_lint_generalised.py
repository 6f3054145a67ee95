"""`ddpkit lint`'s matchers, generalised after the held-back corpus (tests/lint_heldout) showed the
forms they missed: each form here in a script of its own, with the nearby form that must stay silent.
Static: nothing is imported from the scripts.
"""

from __future__ import annotations

import textwrap

from ddpkit.lint import lint_source

HEAD = """
import os, torch, torch.nn as nn, torch.nn.functional as F, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.fsdp import fully_shard
dist.init_process_group("nccl")
rank = dist.get_rank()
"""


def found(body: str) -> list[tuple[str, int]]:
    """(code, line counted from the first line of `body`)."""
    offset = HEAD.count("\n")
    return [(f.code, f.line - offset) for f in lint_source(HEAD + textwrap.dedent(body), "train.py")]


def test_batchnorm_built_by_a_helper_function() -> None:
    body = """
    def block(c):
        return nn.Sequential(nn.Conv2d(c, c, 3), nn.BatchNorm2d(c), nn.ReLU())
    model = DDP(nn.Sequential(block(3), block(3)))
    """
    assert found(body) == [("DDP002", 4)]
    assert found(body.replace("nn.BatchNorm2d(c)", "nn.GroupNorm(1, c)")) == []


def test_optimizer_and_sharding_in_helpers() -> None:
    body = """
    def configure(model):
        groups = [{"params": [p for n, p in model.named_parameters()]}]
        return torch.optim.AdamW(groups)
    def shard(model):
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model
    def main():
        net = Net()
        opt = configure(net)
        net = shard(net)
    """
    assert found(body) == [("DDP001", 12)]
    swapped = body.replace(
        "        opt = configure(net)\n        net = shard(net)",
        "        net = shard(net)\n        opt = configure(net)",
    )
    assert found(swapped) == []


def test_optimizer_in_init_sharded_by_a_method() -> None:
    body = """
    class Trainer:
        def __init__(self, model):
            self.model = model
            self.opt = torch.optim.AdamW(self.model.parameters())
            self._shard()
        def _shard(self):
            self.model = FSDP(self.model)
    """
    assert found(body) == [("DDP001", 5)]
    assert found(body.replace("FSDP(self.model)", "DDP(self.model)")) == []  # DDP keeps the Parameters


def test_summed_loss_through_options_and_helpers() -> None:
    options = """
    model = DDP(Net())
    cfg = {"ignore_index": -100, "reduction": "sum"}
    criterion = nn.CrossEntropyLoss(**cfg)
    loss = criterion(model(x), y)
    loss.backward()
    """
    assert found(options) == [("DDP003", 3)]  # where "sum" is written
    assert found(options.replace('"sum"', '"mean"')) == []
    helper = """
    def elbo(recon, x, kld):
        err = (recon - x).pow(2).flatten(1).sum(1)
        return (err + kld).sum()
    model = DDP(Net())
    def train(x):
        loss = elbo(model(x), x, 0.0)
        loss.backward()
        total = loss.detach()
        dist.all_reduce(total)
    """
    assert found(helper) == [("DDP003", 4)]  # an all_reduce of a metric is no excuse
    by_hand = helper.replace(
        "        dist.all_reduce(total)",
        "        for p in model.parameters():\n            dist.all_reduce(p.grad)",
    )
    assert found(by_hand) == []  # gradients combined by hand: the user chose the arithmetic
    helper_by_hand = (
        helper.rstrip(" ").replace("        dist.all_reduce(total)", "        average_gradients(model)")
        + "    def average_gradients(m):\n        for p in m.parameters():\n            dist.all_reduce(p.grad)\n"
    )
    assert found(helper_by_hand) == []
    assert found(helper.replace("return (err + kld).sum()", "return (err + kld).mean()")) == []


def test_frozen_by_a_helper_after_wrapping() -> None:
    body = """
    def set_trainable(net, trainable):
        for name, p in net.named_parameters():
            if not name.startswith("head"):
                p.requires_grad = trainable
    model = DDP(Net())
    set_trainable(model.module, False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    """
    assert found(body) == [("DDP004", 7)]
    assert (
        found(body.replace("set_trainable(model.module, False)", "set_trainable(model.module, True)")) == []
    )
    before = body.replace(
        "    model = DDP(Net())\n    set_trainable(model.module, False)",
        "    net = Net()\n    set_trainable(net, False)\n    model = DDP(net)",
    )
    assert found(before) == []


def test_device_in_a_dataclass_and_one_finding_per_missing_set_device() -> None:
    config = """
    from dataclasses import dataclass
    @dataclass
    class Config:
        device: str = "cuda:0"
        lr: float = 1e-3
    """
    assert found(config) == [("DDP009", 5)]
    assert found(config.replace('"cuda:0"', '"cuda"')) == []
    bare = """
    model = DDP(Net().cuda())
    mean = torch.zeros(2).cuda()
    std = torch.ones(2).cuda()
    """
    got = lint_source(HEAD + textwrap.dedent(bare), "train.py")
    assert [(f.code, f.line - HEAD.count("\n")) for f in got] == [("DDP009", 2)]
    offset = HEAD.count("\n")
    assert f"also lines {offset + 3}, {offset + 4}" in got[0].message
    assert found("torch.cuda.set_device(rank)\n" + textwrap.dedent(bare)) == []


def test_half_dtype_held_in_a_variable() -> None:
    body = """
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.precision]
    model = Net().to(device=local_device, dtype=dtype)
    model = DDP(model)
    opt = torch.optim.AdamW(model.parameters())
    """
    assert found(body) == [("DDP010", 3)]
    assert [c for c, _ in found(body.replace('"bf16": torch.bfloat16', '"fp64": torch.float64'))] == []


def test_a_seed_under_a_rank_test_is_one_finding() -> None:
    body = """
    import numpy as np, random
    if rank == 0:
        os.makedirs("out", exist_ok=True)
        torch.manual_seed(0)
        np.random.seed(0)
        random.seed(0)
    model = fully_shard(Net())
    """
    assert found(body) == [("DDP008", 5)]


def test_a_combined_metric_printed_on_every_rank() -> None:
    body = """
    model = DDP(Net())
    def validate(correct, seen):
        dist.all_reduce(correct)
        dist.all_reduce(seen)
        acc = (correct / seen).item()
        print(f"val top-1 {acc:.2%}")
    for epoch in range(3):
        validate(correct, seen)
    """
    got = lint_source(HEAD + textwrap.dedent(body), "train.py")
    assert [f.code for f in got] == ["DDP007"] and "same combined" in got[0].message
    assert found(body.replace("        print(", "        if rank == 0:\n            print(")) == []
    message = """
    model = DDP(Net())
    def report(loss):
        msg = "step loss {:.4f}".format(loss)
        print(msg)
    for step in range(10):
        report(1.0)
    """
    assert [c for c, _ in found(message)] == ["DDP007"]
    assert (
        found(
            message.replace('"step loss', '"[rank {}] step loss').replace(
                ".format(loss)", ".format(rank, loss)"
            )
        )
        == []
    )


def test_find_unused_parameters_in_an_options_dict() -> None:
    body = """
    OPTS = {"broadcast_buffers": False, "find_unused_parameters": True}
    class Tower(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.EmbeddingBag(100, 8)
            self.scale = nn.Parameter(torch.tensor(1.0))
        def forward(self, ids, offsets):
            return self.emb(ids, offsets) * self.scale
    def main():
        model = DDP(Tower(), **OPTS)
    """
    assert found(body) == [("DDP012", 2)]
    assert (
        found(body.replace("return self.emb(ids, offsets) * self.scale", "return self.emb(ids, offsets)"))
        == []
    )
