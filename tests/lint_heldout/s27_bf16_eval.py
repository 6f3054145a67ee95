"""Train an MLP-based recommender (fp32 master weights, bf16 autocast), then export a bf16 copy
for serving and run a quick offline evaluation with it."""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from recsys_data import InteractionDataset  # project-local

N_USERS, N_ITEMS, DIM = 200_000, 50_000, 128


class NCF(nn.Module):
    def __init__(self):
        super().__init__()
        self.user = nn.Embedding(N_USERS, DIM)
        self.item = nn.Embedding(N_ITEMS, DIM)
        self.mlp = nn.Sequential(nn.Linear(2 * DIM, 256), nn.ReLU(), nn.Linear(256, 64), nn.ReLU(),
                                 nn.Linear(64, 1))

    def forward(self, u, i):
        return self.mlp(torch.cat([self.user(u), self.item(i)], -1)).squeeze(-1)


def train(model, loader, sampler, opt, epochs, device, rank):
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        acc = torch.zeros(2, device=device)
        for u, i, y in loader:
            u, i, y = u.to(device), i.to(device), y.float().to(device)
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                logits = model(u, i)
            loss = F.binary_cross_entropy_with_logits(logits.float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(acc)
        if rank == 0:
            print(f"epoch {epoch} bce {(acc[0] / acc[1]).item():.4f}")


@torch.no_grad()
def offline_eval(serving_model, test_loader, device):
    hits, total = 0, 0
    for u, i, y in test_loader:
        scores = serving_model(u.to(device), i.to(device)).float()
        hits += ((scores > 0).long().cpu() == y).sum().item()
        total += y.numel()
    return hits / total


def main():
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    torch.manual_seed(0)

    train_ds = InteractionDataset("interactions_train.parquet")
    sampler = DistributedSampler(train_ds, shuffle=True)
    loader = DataLoader(train_ds, batch_size=4096, sampler=sampler, num_workers=4)

    model = DDP(NCF().to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    train(model, loader, sampler, opt, epochs=5, device=device, rank=rank)

    if rank == 0:
        torch.save(model.module.state_dict(), "ncf_fp32.pt")
        serving = model.module.to(torch.bfloat16).eval()
        test_loader = DataLoader(InteractionDataset("interactions_test.parquet"), batch_size=8192)
        print(f"bf16 serving accuracy: {offline_eval(serving, test_loader, device):.4f}")
        torch.save(serving.state_dict(), "ncf_bf16_serving.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
