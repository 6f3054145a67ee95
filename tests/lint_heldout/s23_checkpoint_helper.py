"""BiLSTM sentiment classifier with DDP (mp.spawn) and resumable checkpoints."""
import os
import argparse
from pathlib import Path

import torch
import torch.nn as nn
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from imdb_tokens import IMDBTokens, collate_batch  # project-local


class BiLSTM(nn.Module):
    def __init__(self, vocab, emb=300, hidden=256, n_cls=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, emb, padding_idx=0)
        self.rnn = nn.LSTM(emb, hidden, num_layers=2, bidirectional=True, batch_first=True, dropout=0.3)
        self.out = nn.Linear(2 * hidden, n_cls)

    def forward(self, ids, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(self.emb(ids), lengths.cpu(), batch_first=True,
                                                   enforce_sorted=False)
        _, (h, _) = self.rnn(packed)
        return self.out(torch.cat([h[-2], h[-1]], dim=-1))


def save_checkpoint(model, optimizer, epoch, ckpt_dir):
    """Write a resumable checkpoint and wait until it is on disk."""
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    state = {
        "epoch": epoch,
        "model": model.module.state_dict(),
        "optim": optimizer.state_dict(),
    }
    torch.save(state, ckpt_dir / "latest.pt")
    if dist.is_initialized():
        dist.barrier()


def load_checkpoint(model, optimizer, ckpt_dir, device):
    path = Path(ckpt_dir) / "latest.pt"
    if not path.exists():
        return 0
    state = torch.load(path, map_location=device)
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optim"])
    return state["epoch"] + 1


def worker(rank, world_size, args):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    torch.cuda.set_device(rank)
    torch.manual_seed(args.seed)

    ds = IMDBTokens(args.data, split="train")
    sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank)
    dl = DataLoader(ds, batch_size=args.bs, sampler=sampler, collate_fn=collate_batch)

    model = DDP(BiLSTM(ds.vocab_size).to(rank), device_ids=[rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    start = load_checkpoint(model, opt, args.ckpt, f"cuda:{rank}")
    crit = nn.CrossEntropyLoss()

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for ids, lengths, y in dl:
            ids, y = ids.to(rank), y.to(rank)
            loss = crit(model(ids, lengths), y)
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
        loss_t = loss.detach()
        dist.all_reduce(loss_t, op=dist.ReduceOp.AVG)
        if rank == 0:
            print(f"epoch {epoch} last-batch loss {loss_t.item():.4f}")
        save_checkpoint(model, opt, epoch, args.ckpt)

    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/imdb")
    ap.add_argument("--ckpt", default="ckpt/bilstm")
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    n = torch.cuda.device_count()
    mp.spawn(worker, args=(n, args), nprocs=n)
