"""Tiny contrastive embedding model for product titles; DDP over all local GPUs via torchrun."""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from title_pairs import TitlePairs  # project-local: yields (anchor_ids, positive_ids)

DDP_OPTS = {
    "broadcast_buffers": False,
    "find_unused_parameters": True,
    "gradient_as_bucket_view": True,
}


class BagEncoder(nn.Module):
    def __init__(self, vocab=100_000, dim=256, out=128):
        super().__init__()
        self.emb = nn.EmbeddingBag(vocab, dim, mode="mean")
        self.mlp = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, out))

    def forward(self, ids, offsets):
        return F.normalize(self.mlp(self.emb(ids, offsets)), dim=-1)


class DualTower(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = BagEncoder()
        self.logit_scale = nn.Parameter(torch.tensor(2.659))

    def forward(self, a_ids, a_off, p_ids, p_off):
        za = self.encoder(a_ids, a_off)
        zp = self.encoder(p_ids, p_off)
        return za @ zp.t() * self.logit_scale.exp()


def main():
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    torch.manual_seed(3)

    data = TitlePairs("pairs.tsv")
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=1024, sampler=sampler, collate_fn=data.collate, num_workers=4)

    model = DualTower().cuda()
    model = DistributedDataParallel(model, device_ids=[local_rank], **DDP_OPTS)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    for epoch in range(10):
        sampler.set_epoch(epoch)
        tot, cnt = 0.0, 0
        for a_ids, a_off, p_ids, p_off in loader:
            a_ids, a_off = a_ids.cuda(non_blocking=True), a_off.cuda(non_blocking=True)
            p_ids, p_off = p_ids.cuda(non_blocking=True), p_off.cuda(non_blocking=True)
            logits = model(a_ids, a_off, p_ids, p_off)
            target = torch.arange(logits.size(0), device=logits.device)
            loss = (F.cross_entropy(logits, target) + F.cross_entropy(logits.t(), target)) / 2
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tot += loss.item()
            cnt += 1
        summary = torch.tensor([tot, cnt], device="cuda")
        dist.all_reduce(summary)
        if rank == 0:
            print(f"epoch {epoch} InfoNCE {summary[0].item() / summary[1].item():.4f}")
            torch.save(model.module.encoder.state_dict(), "title_encoder.pt")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
