"""Fine-tune a ViT-B/16 on a folder dataset, linear-probe style warmup then full FT."""
import os
import argparse

import torch
import torch.nn as nn
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms
from torchvision.models import vit_b_16, ViT_B_16_Weights


def init_distributed():
    dist.init_process_group(backend="nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    return dist.get_rank(), dist.get_world_size(), local_rank


def set_backbone_trainable(vit, trainable):
    for name, param in vit.named_parameters():
        if not name.startswith("heads"):
            param.requires_grad = trainable


def build_loaders(root, batch_size, world_size, rank):
    weights = ViT_B_16_Weights.IMAGENET1K_V1
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224),
        transforms.RandomHorizontalFlip(),
        weights.transforms(),
    ])
    train_ds = datasets.ImageFolder(os.path.join(root, "train"), transform=train_tf)
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(train_ds, batch_size=batch_size, sampler=sampler,
                        num_workers=8, pin_memory=True, persistent_workers=True)
    return loader, sampler, len(train_ds.classes)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--bs", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-4)
    args = ap.parse_args()

    rank, world_size, local_rank = init_distributed()
    torch.manual_seed(0)
    loader, sampler, num_classes = build_loaders(args.root, args.bs, world_size, rank)

    vit = vit_b_16(weights=ViT_B_16_Weights.IMAGENET1K_V1)
    vit.heads.head = nn.Linear(vit.heads.head.in_features, num_classes)
    vit = vit.cuda(local_rank)

    model = DDP(vit, device_ids=[local_rank])
    # linear probe first: only the new head learns
    set_backbone_trainable(model.module, False)

    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.05)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        seen = torch.zeros(3, device=local_rank)
        for imgs, targets in loader:
            imgs = imgs.cuda(local_rank, non_blocking=True)
            targets = targets.cuda(local_rank, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(imgs)
                loss = criterion(logits, targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            seen[0] += loss.detach() * targets.numel()
            seen[1] += (logits.argmax(-1) == targets).sum()
            seen[2] += targets.numel()

        dist.all_reduce(seen)
        if rank == 0:
            print(f"epoch {epoch}: loss={seen[0] / seen[2]:.4f} acc={seen[1] / seen[2]:.3%}")
            torch.save(model.module.state_dict(), f"vit_ft_e{epoch}.pt")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
