"""Partial fine-tuning of ConvNeXt-T: replace the head and freeze the early stages, then DDP."""
import os
import argparse

import torch
import torch.nn as nn
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets
from torchvision.models import convnext_tiny, ConvNeXt_Tiny_Weights


def freeze_(module: nn.Module):
    for p in module.parameters():
        p.requires_grad_(False)
    return module


def build_model(num_classes, n_frozen_stages):
    m = convnext_tiny(weights=ConvNeXt_Tiny_Weights.IMAGENET1K_V1)
    in_f = m.classifier[2].in_features
    m.classifier[2] = nn.Linear(in_f, num_classes)
    # features = [stem, stage1, down, stage2, down, stage3, down, stage4]
    for idx in range(2 * n_frozen_stages):
        freeze_(m.features[idx])
    return m


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--classes", type=int, default=102)
    ap.add_argument("--frozen-stages", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--lr", type=float, default=5e-4)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.manual_seed(11)

    weights = ConvNeXt_Tiny_Weights.IMAGENET1K_V1
    ds = datasets.ImageFolder(args.data, transform=weights.transforms())
    sampler = DistributedSampler(ds)
    loader = DataLoader(ds, batch_size=48, sampler=sampler, num_workers=6, pin_memory=True)

    model = build_model(args.classes, args.frozen_stages).to(local_rank)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(trainable(model), lr=args.lr, weight_decay=0.05)
    loss_fn = nn.CrossEntropyLoss()

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        correct = torch.zeros(2, device=local_rank)
        for x, y in loader:
            x, y = x.to(local_rank, non_blocking=True), y.to(local_rank, non_blocking=True)
            out = model(x)
            loss = loss_fn(out, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            correct[0] += (out.argmax(1) == y).sum()
            correct[1] += y.numel()
        dist.all_reduce(correct)
        if rank == 0:
            print(f"epoch {epoch}: train acc {(correct[0] / correct[1]).item():.3f}")

    if rank == 0:
        torch.save(model.module.state_dict(), "convnext_partial_ft.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
