"""Train a torchvision ResNet-50 from scratch on ImageNet-style folders (torchrun, 8 GPUs/node)."""
import os
import time
import argparse

import torch
import torch.nn as nn
import torch.distributed as dist
import torchvision
from torch.utils.data import DataLoader, DistributedSampler
from torchvision import transforms as T


def get_args():
    parser = argparse.ArgumentParser("resnet50 ddp")
    parser.add_argument("--data-path", default="/datasets/imagenet")
    parser.add_argument("--arch", default="resnet50")
    parser.add_argument("--epochs", default=90, type=int)
    parser.add_argument("-b", "--batch-size", default=32, type=int)
    parser.add_argument("--lr", default=0.1, type=float)
    parser.add_argument("--wd", default=1e-4, type=float)
    parser.add_argument("--workers", default=10, type=int)
    parser.add_argument("--output-dir", default="./checkpoints")
    return parser.parse_args()


def make_data(args):
    normalize = T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train = torchvision.datasets.ImageFolder(
        os.path.join(args.data_path, "train"),
        T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), normalize]))
    train_sampler = DistributedSampler(train)
    train_loader = DataLoader(train, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    return train_loader, train_sampler


def main(args):
    dist.init_process_group(backend="nccl", init_method="env://")
    gpu = int(os.environ["LOCAL_RANK"])
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    torch.cuda.set_device(gpu)
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)

    train_loader, train_sampler = make_data(args)

    model = torchvision.models.__dict__[args.arch](weights=None)
    model.cuda()
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[gpu])
    model_without_ddp = model.module

    criterion = nn.CrossEntropyLoss().cuda()
    lr = args.lr * args.batch_size * world_size / 256
    optimizer = torch.optim.SGD(model.parameters(), lr, momentum=0.9, weight_decay=args.wd)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=30, gamma=0.1)

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        start = time.time()
        meter = torch.zeros(3, device="cuda")
        for i, (image, target) in enumerate(train_loader):
            image = image.cuda(non_blocking=True)
            target = target.cuda(non_blocking=True)
            output = model(image)
            loss = criterion(output, target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            meter += torch.tensor([loss.item() * image.size(0),
                                   (output.argmax(1) == target).sum().item(),
                                   image.size(0)], device="cuda")
        lr_scheduler.step()
        dist.all_reduce(meter)
        if rank == 0:
            print(f"Epoch {epoch}: loss {meter[0] / meter[2]:.3f} top1 {100 * meter[1] / meter[2]:.2f} "
                  f"time {time.time() - start:.0f}s")
            os.makedirs(args.output_dir, exist_ok=True)
            torch.save({"model": model_without_ddp.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "lr_scheduler": lr_scheduler.state_dict(),
                        "epoch": epoch},
                       os.path.join(args.output_dir, "checkpoint.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main(get_args())
