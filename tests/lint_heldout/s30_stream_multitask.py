"""Multi-task streaming training: each shard belongs to one task, and each batch only
exercises that task's head, so DDP must tolerate unused parameters."""
import os
import glob
import json
import itertools

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import IterableDataset, DataLoader, get_worker_info

TASKS = {"sentiment": 3, "topic": 20, "toxicity": 2}


class ShardedTaskStream(IterableDataset):
    def __init__(self, pattern, rank, world_size, seq_len=256):
        super().__init__()
        self.files = sorted(glob.glob(pattern))
        self.rank, self.world_size, self.seq_len = rank, world_size, seq_len

    def _my_files(self):
        info = get_worker_info()
        n_workers = info.num_workers if info is not None else 1
        worker_id = info.id if info is not None else 0
        shard_id = self.rank * n_workers + worker_id
        n_shards = self.world_size * n_workers
        return self.files[shard_id::n_shards]

    def __iter__(self):
        for path in self._my_files():
            task = os.path.basename(path).split("-")[0]
            with open(path) as fh:
                for line in fh:
                    rec = json.loads(line)
                    ids = torch.tensor(rec["ids"][: self.seq_len], dtype=torch.long)
                    ids = F.pad(ids, (0, self.seq_len - ids.numel()))
                    yield task, ids, rec["label"]


def collate_same_task(items):
    task = items[0][0]
    assert all(t == task for t, _, _ in items)
    return task, torch.stack([i for _, i, _ in items]), torch.tensor([l for _, _, l in items])


class MultiTaskModel(nn.Module):
    def __init__(self, vocab=32000, dim=384, layers=6):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        enc_layer = nn.TransformerEncoderLayer(dim, 6, 4 * dim, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(enc_layer, layers)
        self.heads = nn.ModuleDict({t: nn.Linear(dim, n) for t, n in TASKS.items()})

    def forward(self, ids, task):
        h = self.encoder(self.emb(ids), src_key_padding_mask=ids.eq(0))
        return self.heads[task](h[:, 0])


def main():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    torch.manual_seed(0)

    stream = ShardedTaskStream("/data/mt/*-*.jsonl", rank, world)
    loader = DataLoader(stream, batch_size=64, num_workers=4, collate_fn=collate_same_task)

    model = MultiTaskModel().cuda(local_rank)
    # only one task head participates in any given step
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4, weight_decay=0.01)

    for step, (task, ids, labels) in enumerate(itertools.islice(loader, 50_000)):
        ids, labels = ids.cuda(local_rank, non_blocking=True), labels.cuda(local_rank, non_blocking=True)
        loss = F.cross_entropy(model(ids, task), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 200 == 0:
            avg = loss.detach().clone()
            dist.all_reduce(avg, op=dist.ReduceOp.AVG)
            if rank == 0:
                print(f"step {step} ({task}) loss {avg.item():.4f}")

    if rank == 0:
        torch.save(model.module.state_dict(), "multitask.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
