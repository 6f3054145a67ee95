"""Swin-T on a 100-class subset with periodic distributed validation (torchrun)."""
import os
import argparse

import torch
import torch.nn as nn
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from torchvision import datasets
from torchvision.models import swin_t, Swin_T_Weights


def make_loaders(root, bs):
    tf = Swin_T_Weights.IMAGENET1K_V1.transforms()
    train = datasets.ImageFolder(os.path.join(root, "train"), tf)
    val = datasets.ImageFolder(os.path.join(root, "val"), tf)
    train_s = DistributedSampler(train, shuffle=True)
    val_s = DistributedSampler(val, shuffle=False)
    return (DataLoader(train, bs, sampler=train_s, num_workers=8, pin_memory=True),
            DataLoader(val, bs, sampler=val_s, num_workers=8, pin_memory=True),
            train_s)


@torch.no_grad()
def validate(model, loader, device, epoch):
    model.eval()
    correct = torch.zeros((), device=device)
    seen = torch.zeros((), device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        correct += (model(x).argmax(dim=1) == y).sum()
        seen += y.numel()
    dist.all_reduce(correct)
    dist.all_reduce(seen)
    acc = (correct / seen).item()
    print(f"epoch {epoch} | val top-1 {acc:.2%}")
    model.train()
    return acc


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/imagenet100")
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device(f"cuda:{local_rank}")
    torch.cuda.set_device(device)
    torch.manual_seed(0)

    train_dl, val_dl, train_sampler = make_loaders(args.root, args.bs)

    net = swin_t(weights=Swin_T_Weights.IMAGENET1K_V1)
    net.head = nn.Linear(net.head.in_features, 100)
    model = DDP(net.to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.epochs)
    crit = nn.CrossEntropyLoss(label_smoothing=0.1)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = crit(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if rank == 0 and i % 200 == 0:
                print(f"epoch {epoch} iter {i} loss {loss.item():.4f}")
        sched.step()
        acc = validate(model, val_dl, device, epoch)
        if acc > best and rank == 0:
            best = acc
            torch.save(model.module.state_dict(), "swin_t_best.pt")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
