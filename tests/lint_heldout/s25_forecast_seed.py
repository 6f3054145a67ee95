"""Multi-horizon load forecasting with a GRU encoder; DDP, wandb logging on the master process."""
import os
import json
import argparse

import numpy as np
import torch
import torch.nn as nn
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
import wandb


class Windows(Dataset):
    def __init__(self, path, lookback=168, horizon=24):
        self.series = np.load(path).astype(np.float32)  # (T, n_series)
        self.lb, self.h = lookback, horizon

    def __len__(self):
        return self.series.shape[0] - self.lb - self.h

    def __getitem__(self, i):
        x = self.series[i:i + self.lb]
        y = self.series[i + self.lb:i + self.lb + self.h]
        return torch.from_numpy(x), torch.from_numpy(y)


class Forecaster(nn.Module):
    def __init__(self, n_series, hidden=256, horizon=24):
        super().__init__()
        self.gru = nn.GRU(n_series, hidden, num_layers=2, batch_first=True, dropout=0.1)
        self.head = nn.Linear(hidden, horizon * n_series)
        self.horizon, self.n = horizon, n_series

    def forward(self, x):
        _, h = self.gru(x)
        return self.head(h[-1]).view(-1, self.horizon, self.n)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="load.npy")
    ap.add_argument("--out", default="runs/gru")
    ap.add_argument("--seed", type=int, default=2023)
    ap.add_argument("--epochs", type=int, default=25)
    ap.add_argument("--bs", type=int, default=256)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    master_process = rank == 0

    if master_process:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)
        wandb.init(project="load-forecast", config=vars(args))
        torch.manual_seed(args.seed)
        np.random.seed(args.seed)

    ds = Windows(args.data)
    sampler = DistributedSampler(ds, shuffle=True)
    dl = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=4, drop_last=True)

    model = Forecaster(ds.series.shape[1]).cuda()
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    l1 = nn.L1Loss()

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        s = torch.zeros(2, device="cuda")
        for x, y in dl:
            x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
            loss = l1(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            s += torch.stack([loss.detach(), torch.ones((), device="cuda")])
        dist.all_reduce(s)
        if master_process:
            mae = (s[0] / s[1]).item()
            wandb.log({"epoch": epoch, "train_mae": mae})
            torch.save(model.module.state_dict(), os.path.join(args.out, "model.pt"))

    if master_process:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
