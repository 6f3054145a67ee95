"""Churn model: DDP training of a wide&deep net on categorical + numeric features."""
import os
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler


@dataclass
class TrainConfig:
    data_file: str = "churn.pt"
    cardinalities: list = field(default_factory=lambda: [12, 7, 53, 400, 3])
    emb_dim: int = 16
    n_numeric: int = 24
    hidden: int = 256
    epochs: int = 15
    batch_size: int = 1024
    lr: float = 2e-3
    device: str = "cuda:0"


class ChurnData(Dataset):
    def __init__(self, path):
        blob = torch.load(path)
        self.cat, self.num, self.y = blob["cat"], blob["num"], blob["y"].float()

    def __len__(self):
        return self.y.shape[0]

    def __getitem__(self, i):
        return self.cat[i], self.num[i], self.y[i]


class WideDeep(nn.Module):
    def __init__(self, cfg: TrainConfig):
        super().__init__()
        self.embs = nn.ModuleList(nn.Embedding(c, cfg.emb_dim) for c in cfg.cardinalities)
        d_in = cfg.emb_dim * len(cfg.cardinalities) + cfg.n_numeric
        self.deep = nn.Sequential(nn.Linear(d_in, cfg.hidden), nn.ReLU(),
                                  nn.Linear(cfg.hidden, cfg.hidden), nn.ReLU(),
                                  nn.Linear(cfg.hidden, 1))
        self.wide = nn.Linear(cfg.n_numeric, 1)

    def forward(self, cat, num):
        e = torch.cat([emb(cat[:, i]) for i, emb in enumerate(self.embs)], dim=1)
        return (self.deep(torch.cat([e, num], dim=1)) + self.wide(num)).squeeze(1)


def run(cfg: TrainConfig):
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    torch.manual_seed(7)

    ds = ChurnData(cfg.data_file)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=cfg.batch_size, sampler=sampler, num_workers=2)

    model = WideDeep(cfg).to(cfg.device)
    model = DDP(model)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    bce = nn.BCEWithLogitsLoss()

    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        agg = torch.zeros(2, device=cfg.device)
        for cat, num, y in dl:
            cat, num, y = cat.to(cfg.device), num.to(cfg.device), y.to(cfg.device)
            loss = bce(model(cat, num), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            agg[0] += loss.detach()
            agg[1] += 1
        dist.all_reduce(agg)
        if rank == 0:
            print(f"epoch {epoch}: bce {agg[0].item() / agg[1].item():.4f}")

    if rank == 0:
        torch.save(model.module.state_dict(), "widedeep.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    run(TrainConfig())
