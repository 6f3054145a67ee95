"""Train a small transformer seq2seq model (translation) with DDP.

Usage: torchrun --nproc_per_node=4 s11_seq2seq_seed.py --src de --tgt en
"""
import os
import random
import argparse

import numpy as np
import torch
import torch.nn as nn
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from data import ParallelCorpus, pad_collate  # project-local


def seed_everything(seed: int):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class Seq2Seq(nn.Module):
    def __init__(self, src_vocab, tgt_vocab, d_model=512, nhead=8, layers=6, pad_id=0):
        super().__init__()
        self.src_emb = nn.Embedding(src_vocab, d_model, padding_idx=pad_id)
        self.tgt_emb = nn.Embedding(tgt_vocab, d_model, padding_idx=pad_id)
        self.core = nn.Transformer(d_model, nhead, layers, layers, dim_feedforward=2048,
                                   dropout=0.1, batch_first=True)
        self.proj = nn.Linear(d_model, tgt_vocab)
        self.pad_id = pad_id

    def forward(self, src, tgt_in):
        causal = self.core.generate_square_subsequent_mask(tgt_in.size(1)).to(src.device)
        h = self.core(self.src_emb(src), self.tgt_emb(tgt_in), tgt_mask=causal,
                      src_key_padding_mask=src.eq(self.pad_id),
                      tgt_key_padding_mask=tgt_in.eq(self.pad_id))
        return self.proj(h)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--src", default="de")
    p.add_argument("--tgt", default="en")
    p.add_argument("--seed", type=int, default=17)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=5e-4)
    return p.parse_args()


def main():
    args = get_args()
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    rank = dist.get_rank()

    seed_everything(args.seed + rank)

    corpus = ParallelCorpus(f"data/train.{args.src}", f"data/train.{args.tgt}")
    sampler = DistributedSampler(corpus, shuffle=True, seed=args.seed)
    loader = DataLoader(corpus, batch_size=args.batch_size, sampler=sampler,
                        collate_fn=pad_collate, num_workers=4)

    model = Seq2Seq(corpus.src_vocab_size, corpus.tgt_vocab_size).cuda()
    model = DDP(model, device_ids=[local_rank])
    criterion = nn.CrossEntropyLoss(ignore_index=0, label_smoothing=0.1)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-9)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tot = torch.zeros(2, device="cuda")
        for src, tgt in loader:
            src, tgt = src.cuda(non_blocking=True), tgt.cuda(non_blocking=True)
            logits = model(src, tgt[:, :-1])
            loss = criterion(logits.reshape(-1, logits.size(-1)), tgt[:, 1:].reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            tot += torch.stack([loss.detach(), torch.ones((), device="cuda")])
        dist.all_reduce(tot)
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs} avg loss {(tot[0] / tot[1]).item():.4f}")
            torch.save(model.module.state_dict(), f"seq2seq_{args.src}{args.tgt}.pt")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
