"""Pretraining a small decoder-only transformer with FSDP2 (fully_shard). Launch with torchrun."""
import os
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy
from torch.distributed.checkpoint.state_dict import get_model_state_dict, StateDictOptions


class Block(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, n_heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab=32000, dim=768, n_layers=12, n_heads=12, ctx=1024):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(ctx, dim)
        self.layers = nn.ModuleList([Block(dim, n_heads) for _ in range(n_layers)])
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        T = idx.size(1)
        mask = torch.triu(torch.full((T, T), float("-inf"), device=idx.device), 1)
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        for layer in self.layers:
            x = layer(x, mask)
        return self.out(self.norm(x))


def configure_optimizer(model, lr, weight_decay=0.1):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=True)


def shard_model(model):
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mp_policy=mp_policy)
    fully_shard(model, mp_policy=mp_policy)
    return model


def get_batch(data, batch_size, ctx, device):
    ix = torch.randint(len(data) - ctx - 1, (batch_size,))
    x = torch.stack([data[i:i + ctx] for i in ix]).to(device, non_blocking=True)
    y = torch.stack([data[i + 1:i + 1 + ctx] for i in ix]).to(device, non_blocking=True)
    return x, y


def lr_at(step, warmup, total, peak):
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 * peak + 0.9 * peak * 0.5 * (1 + math.cos(math.pi * progress))


def main():
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1337)

    max_steps, warmup, peak_lr = 20000, 500, 6e-4
    batch_size, ctx = 8, 1024

    data = torch.from_numpy(
        __import__("numpy").memmap("train.bin", dtype="uint16", mode="r").astype("int64"))

    model = TinyLM(ctx=ctx).to(device)
    optimizer = configure_optimizer(model, peak_lr)
    model = shard_model(model)

    # each rank draws different random batches
    torch.manual_seed(1337 + rank)
    t0 = time.time()
    for step in range(max_steps):
        for g in optimizer.param_groups:
            g["lr"] = lr_at(step, warmup, max_steps, peak_lr)
        x, y = get_batch(data, batch_size, ctx, device)
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        if step % 100 == 0:
            loss_avg = loss.detach().clone()
            dist.all_reduce(loss_avg, op=dist.ReduceOp.AVG)
            if rank == 0:
                dt = time.time() - t0
                print(f"step {step} loss {loss_avg.item():.4f} ({dt:.1f}s)")
                t0 = time.time()

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save(sd, "tinylm_final.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
