"""Deep residual MLP-Mixer on 64x64 images, activation checkpointing to fit batch 256/GPU."""
import os
import argparse

import torch
import torch.nn as nn
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint as ckpt
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


class MixerBlock(nn.Module):
    def __init__(self, n_tokens, dim, token_hidden=256, channel_hidden=1024):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.token_mlp = nn.Sequential(nn.Linear(n_tokens, token_hidden), nn.GELU(),
                                       nn.Linear(token_hidden, n_tokens))
        self.ln2 = nn.LayerNorm(dim)
        self.channel_mlp = nn.Sequential(nn.Linear(dim, channel_hidden), nn.GELU(),
                                         nn.Linear(channel_hidden, dim))

    def forward(self, x):
        x = x + self.token_mlp(self.ln1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mlp(self.ln2(x))


class Mixer(nn.Module):
    def __init__(self, img=64, patch=8, dim=512, depth=24, n_classes=200, grad_ckpt=True):
        super().__init__()
        n_tokens = (img // patch) ** 2
        self.stem = nn.Conv2d(3, dim, patch, patch)
        self.blocks = nn.ModuleList(MixerBlock(n_tokens, dim) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, n_classes)
        self.grad_ckpt = grad_ckpt

    def forward(self, x):
        x = self.stem(x).flatten(2).transpose(1, 2)
        for blk in self.blocks:
            if self.grad_ckpt and self.training:
                x = ckpt(blk, x)
            else:
                x = blk(x)
        return self.head(self.norm(x).mean(1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/tiny-imagenet-200")
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--bs", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank = dist.get_rank()
    lr_ = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(lr_)
    torch.manual_seed(0)

    tf = transforms.Compose([transforms.RandomCrop(64, padding=4), transforms.RandomHorizontalFlip(),
                             transforms.ToTensor()])
    ds = datasets.ImageFolder(os.path.join(args.data, "train"), tf)
    sampler = DistributedSampler(ds, shuffle=True)
    dl = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=8, pin_memory=True)

    model = DDP(Mixer().cuda(lr_), device_ids=[lr_])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    crit = nn.CrossEntropyLoss(label_smoothing=0.1)

    for ep in range(args.epochs):
        sampler.set_epoch(ep)
        model.train()
        acc = torch.zeros(2, device="cuda")
        for x, y in dl:
            x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
            loss = crit(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            acc += torch.stack([loss.detach(), torch.ones((), device="cuda")])
        sched.step()
        dist.all_reduce(acc)
        if rank == 0:
            print(f"ep {ep} loss {(acc[0] / acc[1]).item():.4f}")
            torch.save(model.module.state_dict(), "mixer.pt")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
