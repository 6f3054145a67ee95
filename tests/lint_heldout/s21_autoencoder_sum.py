"""Convolutional beta-VAE on CelebA 64x64, DDP via torchrun."""
import os
import argparse

import torch
import torch.nn as nn
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from torchvision import datasets, transforms
from torchvision.utils import save_image


class VAE(nn.Module):
    def __init__(self, z=128):
        super().__init__()
        self.enc = nn.Sequential(
            nn.Conv2d(3, 32, 4, 2, 1), nn.LeakyReLU(0.2),
            nn.Conv2d(32, 64, 4, 2, 1), nn.LeakyReLU(0.2),
            nn.Conv2d(64, 128, 4, 2, 1), nn.LeakyReLU(0.2),
            nn.Conv2d(128, 256, 4, 2, 1), nn.LeakyReLU(0.2),
            nn.Flatten(),
        )
        self.mu = nn.Linear(256 * 16, z)
        self.logvar = nn.Linear(256 * 16, z)
        self.dec_in = nn.Linear(z, 256 * 16)
        self.dec = nn.Sequential(
            nn.ConvTranspose2d(256, 128, 4, 2, 1), nn.LeakyReLU(0.2),
            nn.ConvTranspose2d(128, 64, 4, 2, 1), nn.LeakyReLU(0.2),
            nn.ConvTranspose2d(64, 32, 4, 2, 1), nn.LeakyReLU(0.2),
            nn.ConvTranspose2d(32, 3, 4, 2, 1), nn.Sigmoid(),
        )

    def forward(self, x):
        h = self.enc(x)
        mu, logvar = self.mu(h), self.logvar(h)
        z = mu + torch.randn_like(mu) * (0.5 * logvar).exp()
        return self.dec(self.dec_in(z).view(-1, 256, 4, 4)), mu, logvar


def elbo_loss(recon, x, mu, logvar, beta):
    recon_err = (recon - x).pow(2).flatten(1).sum(1)
    kld = -0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).sum(1)
    return (recon_err + beta * kld).sum()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/celeba")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--bs", type=int, default=128)
    ap.add_argument("--beta", type=float, default=4.0)
    ap.add_argument("--lr", type=float, default=2e-4)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    torch.manual_seed(5)

    tf = transforms.Compose([transforms.CenterCrop(148), transforms.Resize(64), transforms.ToTensor()])
    ds = datasets.CelebA(args.root, split="train", transform=tf, download=False)
    sampler = DistributedSampler(ds, shuffle=True)
    dl = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=8, drop_last=True)

    vae = DDP(VAE().to(device), device_ids=[device.index])
    opt = torch.optim.Adam(vae.parameters(), lr=args.lr)

    fixed = next(iter(dl))[0][:32].to(device)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        vae.train()
        total, count = torch.zeros((), device=device), torch.zeros((), device=device)
        for x, _ in dl:
            x = x.to(device, non_blocking=True)
            recon, mu, logvar = vae(x)
            loss = elbo_loss(recon, x, mu, logvar, args.beta)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.detach()
            count += x.size(0)
        dist.all_reduce(total)
        dist.all_reduce(count)
        if rank == 0:
            print(f"epoch {epoch}: -ELBO per image {(total / count).item():.2f}")
            with torch.no_grad():
                vae.module.eval()
                save_image(torch.cat([fixed, vae.module(fixed)[0]]), f"recon_{epoch:03d}.png", nrow=8)
            torch.save(vae.module.state_dict(), "vae.pt")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
