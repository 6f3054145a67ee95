#!/usr/bin/env python
"""Fine-tune a causal LM on tokenized shards with DDP.

torchrun --nproc_per_node 4 s05_lm_argparse.py --data shards/ --epochs 3
"""
import argparse
import glob
import os

import torch
import torch.nn as nn
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset, DistributedSampler
from transformers import AutoModelForCausalLM


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gpt2")
    p.add_argument("--data", required=True)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--out", default="ckpt")
    return p.parse_args()


def load_shards(path):
    tensors = [torch.load(f) for f in sorted(glob.glob(os.path.join(path, "*.pt")))]
    input_ids = torch.cat([t["input_ids"] for t in tensors])
    labels = torch.cat([t["labels"] for t in tensors])
    return TensorDataset(input_ids, labels)


def main():
    args = parse_args()
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    torch.manual_seed(args.seed)

    ds = load_shards(args.data)
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed)
    dl = DataLoader(ds, batch_size=args.micro_batch, sampler=sampler, num_workers=2, drop_last=True)

    lm = AutoModelForCausalLM.from_pretrained(args.model).cuda(local_rank)
    model = DistributedDataParallel(lm, device_ids=[local_rank], output_device=local_rank)

    loss_cfg = {"ignore_index": -100, "reduction": "sum"}
    criterion = nn.CrossEntropyLoss(**loss_cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total_steps = args.epochs * len(dl)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=total_steps, pct_start=0.05)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for input_ids, labels in dl:
            input_ids = input_ids.cuda(local_rank, non_blocking=True)
            labels = labels.cuda(local_rank, non_blocking=True)
            logits = model(input_ids=input_ids).logits
            shift_logits = logits[:, :-1].reshape(-1, logits.size(-1))
            shift_labels = labels[:, 1:].reshape(-1)
            loss = criterion(shift_logits, shift_labels)

            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1

            if step % 50 == 0:
                stats = loss.detach().reshape(1)
                dist.reduce(stats, dst=0)
                if rank == 0:
                    print(f"[epoch {epoch} step {step}] summed loss across ranks {stats.item():.2f}")

        if rank == 0:
            os.makedirs(args.out, exist_ok=True)
            model.module.save_pretrained(os.path.join(args.out, f"epoch{epoch}"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
