"""Variable-length LM training with exact per-token loss normalisation across ranks.

Each rank's batch has a different number of non-pad tokens, so we sum the token losses and
normalise by the global token count (DDP averages grads over ranks, hence the * world_size).
"""
import os
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from lm_data import BucketedTextDataset, collate_pad  # project-local
from lm_model import DecoderLM

PAD = 0


def global_count(n_local: torch.Tensor) -> torch.Tensor:
    n = n_local.detach().clone()
    dist.all_reduce(n, op=dist.ReduceOp.SUM)
    return n


def token_loss(logits, targets, world_size):
    flat_logits = logits.reshape(-1, logits.size(-1))
    flat_tgt = targets.reshape(-1)
    summed = F.cross_entropy(flat_logits, flat_tgt, ignore_index=PAD, reduction="sum")
    n_tokens = global_count((flat_tgt != PAD).sum())
    return summed * world_size / n_tokens.clamp(min=1), n_tokens


def main():
    dist.init_process_group("nccl")
    world_size = dist.get_world_size()
    rank = dist.get_rank()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(2024)

    ds = BucketedTextDataset("corpus/train.jsonl", max_len=2048)
    sampler = DistributedSampler(ds, shuffle=True)
    dl = DataLoader(ds, batch_size=16, sampler=sampler, collate_fn=collate_pad, num_workers=4)

    model = DDP(DecoderLM(vocab_size=50304, d_model=1024, n_layers=16).to(dev),
                device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)

    for epoch in range(4):
        sampler.set_epoch(epoch)
        for it, (inp, tgt) in enumerate(dl):
            inp, tgt = inp.to(dev, non_blocking=True), tgt.to(dev, non_blocking=True)
            logits = model(inp)
            loss, n_tok = token_loss(logits, tgt, world_size)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()

            if it % 50 == 0:
                per_token = loss.detach() / world_size
                dist.all_reduce(per_token)
                if rank == 0:
                    print(f"ep {epoch} it {it} tokens {int(n_tok)} "
                          f"nll/token {per_token.item():.4f} ppl {math.exp(per_token.item()):.1f}")

        if rank == 0:
            torch.save({"model": model.module.state_dict(), "epoch": epoch}, f"lm_ep{epoch}.pt")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
