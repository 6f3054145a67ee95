"""Rank functions for tests/test_fsdp_init.py (run in the shared rank pools; importable by pickle)."""

from __future__ import annotations

import resource

import torch
import torch.nn.functional as F
from fsdp_train import data, full_params, net
from torch import nn

import ddpkit
from ddpkit.strategy import FSDPOptions


class Mixed(nn.Module):
    """Initialisation the way real models write it: modules' reset_parameters, nn.init on views and
    whole tensors, torch.randn in a constructor, a constant buffer, tied weights, a later init pass."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8, padding_idx=3)  # normal_, then a row of the view set to 0
        self.pos = nn.Parameter(torch.randn(5, 8))
        self.ln = nn.LayerNorm(8)
        self.q = nn.Linear(8, 9)
        nn.init.orthogonal_(self.q.weight)  # returns early on meta tensors in torch: ddpkit runs it
        nn.init.trunc_normal_(self.q.bias, std=0.02)
        self.bn = nn.BatchNorm1d(9)
        self.register_buffer("scale", torch.tensor([0.5, 2.0]))
        self.out = nn.Linear(9, 4)
        self.apply(self._init)
        with torch.no_grad():
            self.ln.weight.mul_(0.5)  # reads the sharded values back: one all-gather

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear) and m.out_features == 4:
            nn.init.normal_(m.weight, 0.0, 0.02)
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.ln(self.emb(idx) + self.pos[: idx.shape[1]]).mean(1) * self.scale[0]
        return self.out(self.bn(self.q(h)))


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    out = full_params(model)
    out.update({f"buffer:{n}": b.detach().clone() for n, b in ddpkit.unwrap(model).named_buffers()})
    return out


def initial(factory_name: str, options: bool, whole: bool = False) -> dict:
    """The FSDP model's initial weights, gathered once; and one process's, built here from the same seed."""
    factory = {"net": net, "mixed": Mixed}[factory_name]
    with ddpkit.session(seed=0, verbose=False) as s:
        strategy = FSDPOptions(blocks=(nn.Linear,)) if options else "fsdp"
        model = s.model(factory() if whole else factory, strategy=strategy)
        torch.manual_seed(0)
        reference = factory()
        local = sum(p.to_local().numel() for p in model.parameters())
        return {
            "fsdp": _state(model),
            "one": _state(reference),
            "local": local,
            "total": sum(p.numel() for p in reference.parameters()),
        }


def trains(world_batches: int = 4) -> list[float]:
    """A factory-built FSDP model trains (forward, backward, step) and its losses agree across ranks."""
    with ddpkit.session(seed=0, verbose=False, strategy="fsdp") as s:
        model = s.model(net)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for x, y in s.loader(data(), batch_size=16):
            with s.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                s.backward(loss)
            s.step(opt, max_norm=1.0)
            losses.append(float(s.all_reduce(loss.detach(), op="mean")))
        return losses


def different_seeds_factory() -> str:
    with ddpkit.session(seed=0, verbose=False) as s:
        torch.manual_seed(s.rank)  # a per-rank seed before the model
        try:
            s.model(net, strategy="fsdp")
        except ddpkit.DdpkitError as err:
            return str(err)
    return "no error"


def meta_module() -> str:
    with ddpkit.session(seed=0, verbose=False) as s:
        with torch.device("meta"):
            built = net()
        try:
            s.model(built, strategy="fsdp")
        except ddpkit.DdpkitError as err:
            return str(err)
    return "no error"


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def export_streamed(root: str) -> int:
    """The factory-built model exported twice: streamed (fsdp_export) and by s.export (gathered)."""
    from ddpkit.strategy import fsdp_export

    with ddpkit.session(seed=0, verbose=False, strategy="fsdp") as s:
        model = s.model(Mixed)
        n = fsdp_export.write(model, f"{root}/streamed.safetensors", s.rank)
        s.export(f"{root}/gathered.safetensors", model)
        return n
