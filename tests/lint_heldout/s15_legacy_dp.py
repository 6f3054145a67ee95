"""Semantic segmentation training (DeepLabV3) on all visible GPUs."""
import os
import argparse
import logging

import torch
import torch.nn as nn
from torch.nn import DataParallel as Parallel
from torch.utils.data import DataLoader
from torchvision.models.segmentation import deeplabv3_resnet50
from torchvision.datasets import VOCSegmentation
import torchvision.transforms.v2 as T

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
log = logging.getLogger("seg")


def build_dataset(root):
    tf = T.Compose([
        T.RandomResizedCrop(480, scale=(0.5, 2.0), antialias=True),
        T.RandomHorizontalFlip(),
        T.ToImage(),
        T.ToDtype(torch.float32, scale=True),
        T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
    ])
    return VOCSegmentation(root, year="2012", image_set="train", transforms=tf)


def poly_lr(optimizer, base_lr, it, max_it, power=0.9):
    lr = base_lr * (1 - it / max_it) ** power
    for g in optimizer.param_groups:
        g["lr"] = lr
    return lr


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/voc")
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--ckpt-dir", default="runs/deeplab")
    args = ap.parse_args()

    torch.manual_seed(0)
    device = torch.device("cuda")
    n_gpu = torch.cuda.device_count()
    log.info("training on %d GPUs", n_gpu)

    ds = build_dataset(args.root)
    loader = DataLoader(ds, batch_size=args.batch_size, shuffle=True, num_workers=16,
                        pin_memory=True, drop_last=True)

    net = deeplabv3_resnet50(weights=None, num_classes=21, aux_loss=True)
    if n_gpu > 1:
        net = Parallel(net)
    net.to(device)

    criterion = nn.CrossEntropyLoss(ignore_index=255)
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)

    max_it = args.epochs * len(loader)
    it = 0
    os.makedirs(args.ckpt_dir, exist_ok=True)
    for epoch in range(args.epochs):
        net.train()
        for img, mask in loader:
            img, mask = img.to(device, non_blocking=True), mask.to(device, non_blocking=True).long().squeeze(1)
            out = net(img)
            loss = criterion(out["out"], mask) + 0.4 * criterion(out["aux"], mask)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            lr = poly_lr(optimizer, args.lr, it, max_it)
            it += 1
            if it % 50 == 0:
                log.info("epoch %d iter %d loss %.4f lr %.5f", epoch, it, loss.item(), lr)

        state = net.module.state_dict() if isinstance(net, Parallel) else net.state_dict()
        torch.save({"model": state, "epoch": epoch}, os.path.join(args.ckpt_dir, "last.pth"))


if __name__ == "__main__":
    main()
