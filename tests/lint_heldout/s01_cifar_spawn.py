"""Small CIFAR-10 convnet trained with DistributedDataParallel (mp.spawn launcher)."""
import os
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def setup(rank, world_size):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "12355"
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    torch.cuda.set_device(rank)


def cleanup():
    dist.destroy_process_group()


def conv_block(cin, cout):
    return nn.Sequential(
        nn.Conv2d(cin, cout, kernel_size=3, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
    )


class SmallNet(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.features = nn.Sequential(
            conv_block(3, 64),
            conv_block(64, 128),
            nn.MaxPool2d(2),
            conv_block(128, 256),
            nn.MaxPool2d(2),
            conv_block(256, 256),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(256, num_classes)

    def forward(self, x):
        x = self.features(x)
        return self.head(torch.flatten(x, 1))


def get_loader(rank, world_size, batch_size):
    tf = transforms.Compose([
        transforms.RandomCrop(32, padding=4),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize((0.4914, 0.4822, 0.4465), (0.247, 0.243, 0.261)),
    ])
    ds = datasets.CIFAR10("./data", train=True, download=(rank == 0), transform=tf)
    sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(ds, batch_size=batch_size, sampler=sampler,
                        num_workers=4, pin_memory=True, drop_last=True)
    return loader, sampler


def train(rank, world_size, args):
    setup(rank, world_size)
    torch.manual_seed(args.seed)

    if rank == 0:
        datasets.CIFAR10("./data", train=True, download=True)
    dist.barrier()
    loader, sampler = get_loader(rank, world_size, args.batch_size)

    model = SmallNet().to(rank)
    ddp_model = DDP(model, device_ids=[rank])

    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=args.lr,
                                momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        ddp_model.train()
        running = torch.zeros(2, device=rank)
        for images, labels in loader:
            images = images.to(rank, non_blocking=True)
            labels = labels.to(rank, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            out = ddp_model(images)
            loss = F.cross_entropy(out, labels)
            loss.backward()
            optimizer.step()
            running[0] += loss.detach() * labels.size(0)
            running[1] += labels.size(0)
        scheduler.step()

        dist.all_reduce(running, op=dist.ReduceOp.SUM)
        if rank == 0:
            print(f"epoch {epoch}: train loss {(running[0] / running[1]).item():.4f}")

    if rank == 0:
        torch.save(ddp_model.module.state_dict(), "cifar_smallnet.pt")
    cleanup()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    world_size = torch.cuda.device_count()
    mp.spawn(train, args=(world_size, args), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
