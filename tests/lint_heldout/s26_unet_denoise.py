"""Image denoising UNet (GroupNorm) trained with DDP; launched by torchrun on one 4-GPU node."""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

EPOCHS, BS, LR, SIGMA = 50, 32, 2e-4, 0.1


def block(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(8, cout), nn.SiLU(),
                         nn.Conv2d(cout, cout, 3, padding=1), nn.GroupNorm(8, cout), nn.SiLU())


class UNet(nn.Module):
    def __init__(self, ch=(64, 128, 256)):
        super().__init__()
        self.d1, self.d2, self.d3 = block(3, ch[0]), block(ch[0], ch[1]), block(ch[1], ch[2])
        self.u2 = block(ch[2] + ch[1], ch[1])
        self.u1 = block(ch[1] + ch[0], ch[0])
        self.out = nn.Conv2d(ch[0], 3, 1)

    def forward(self, x):
        h1 = self.d1(x)
        h2 = self.d2(F.avg_pool2d(h1, 2))
        h3 = self.d3(F.avg_pool2d(h2, 2))
        u = self.u2(torch.cat([F.interpolate(h3, scale_factor=2), h2], 1))
        u = self.u1(torch.cat([F.interpolate(u, scale_factor=2), h1], 1))
        return x - self.out(u)


def get_data(rank, world):
    tf = transforms.Compose([transforms.RandomCrop(128), transforms.RandomHorizontalFlip(),
                             transforms.ToTensor()])
    ds = datasets.ImageFolder("/data/div2k_patches", tf)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True)
    return DataLoader(ds, batch_size=BS, sampler=sampler, num_workers=6, drop_last=True), sampler


def psnr(a, b):
    return 10 * torch.log10(1.0 / F.mse_loss(a.clamp(0, 1), b))


def main():
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    torch.manual_seed(0)

    loader, sampler = get_data(rank, world)
    model = UNet().cuda()
    model = DDP(model)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, EPOCHS)

    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        metric = torch.zeros(2).cuda()
        for clean, _ in loader:
            clean = clean.cuda(non_blocking=True)
            noisy = clean + SIGMA * torch.randn_like(clean)
            pred = model(noisy)
            loss = F.l1_loss(pred, clean)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            with torch.no_grad():
                metric += torch.stack([psnr(pred, clean), torch.ones(()).cuda()])
        sched.step()
        dist.all_reduce(metric)
        if rank == 0:
            print(f"epoch {epoch}: train PSNR {(metric[0] / metric[1]).item():.2f} dB")
            torch.save(model.module.state_dict(), "unet_denoise.pt")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
