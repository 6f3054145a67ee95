"""Distributed training of an MLP regressor on a parquet feature table.

torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $HOST:29400 \
    s08_regression_torchrun.py
"""
import os
import time

import pandas as pd
import torch
import torch.nn as nn
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

LOCAL_RANK = int(os.environ["LOCAL_RANK"])
RANK = int(os.environ["RANK"])
WORLD_SIZE = int(os.environ["WORLD_SIZE"])

EPOCHS = 20
BATCH = 512
LR = 1e-3


def load_table(path="features.parquet"):
    df = pd.read_parquet(path)
    x = torch.tensor(df.drop(columns=["target"]).values, dtype=torch.float32)
    y = torch.tensor(df["target"].values, dtype=torch.float32).unsqueeze(1)
    return TensorDataset(x, y)


def make_model(n_in):
    return nn.Sequential(
        nn.Linear(n_in, 512), nn.SiLU(),
        nn.Linear(512, 512), nn.SiLU(),
        nn.Linear(512, 256), nn.SiLU(),
        nn.Linear(256, 1),
    )


def report(epoch, step, loss, t):
    msg = "[rank {}/{}] epoch {:02d} step {:05d} mse {:.5f} ({:.1f} ms/step)".format(
        RANK, WORLD_SIZE, epoch, step, loss, t * 1000)
    print(msg, flush=True)


def train():
    dist.init_process_group("nccl")
    torch.cuda.set_device(LOCAL_RANK)
    device = torch.device(f"cuda:{LOCAL_RANK}")
    torch.manual_seed(1234)

    ds = load_table()
    sampler = DistributedSampler(ds)
    loader = DataLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=4, pin_memory=True)

    net = make_model(ds.tensors[0].shape[1]).to(device)
    net = DDP(net, device_ids=[LOCAL_RANK])
    opt = torch.optim.Adam(net.parameters(), lr=LR)
    loss_fn = nn.MSELoss()

    step = 0
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            t0 = time.perf_counter()
            xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            pred = net(xb)
            loss = loss_fn(pred, yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if step % 100 == 0:
                report(epoch, step, loss.item(), time.perf_counter() - t0)

    if RANK == 0:
        torch.save(net.module.state_dict(), "regressor.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    train()
