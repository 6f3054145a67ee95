"""Streaming pretraining on a directory of .jsonl.gz shards (too big for a map-style dataset)."""
import os
import glob
import gzip
import json
import itertools

import torch
import torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import IterableDataset, DataLoader
from tokenizers import Tokenizer

from lm_model import DecoderLM  # project-local


class JsonlStream(IterableDataset):
    """Packs tokenized documents into fixed-length blocks."""

    def __init__(self, pattern, tokenizer_path, block_size=2048):
        super().__init__()
        self.files = sorted(glob.glob(pattern))
        self.tok = Tokenizer.from_file(tokenizer_path)
        self.block = block_size
        self.eos = self.tok.token_to_id("</s>")

    def _documents(self):
        for path in self.files:
            with gzip.open(path, "rt", encoding="utf-8") as fh:
                for line in fh:
                    yield json.loads(line)["text"]

    def __iter__(self):
        buf = []
        for text in self._documents():
            buf.extend(self.tok.encode(text).ids + [self.eos])
            while len(buf) >= self.block + 1:
                chunk, buf = buf[: self.block + 1], buf[self.block:]
                t = torch.tensor(chunk, dtype=torch.long)
                yield t[:-1], t[1:]


def main():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    torch.manual_seed(0)

    stream = JsonlStream("/data/pile/train/*.jsonl.gz", "tokenizer.json", block_size=2048)
    loader = DataLoader(stream, batch_size=8, num_workers=6, pin_memory=True, prefetch_factor=4)

    model = DDP(DecoderLM(vocab_size=50304, d_model=1024, n_layers=24).cuda(), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 2000))

    max_steps = 100_000
    for step, (x, y) in enumerate(itertools.islice(loader, max_steps)):
        x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)

        if step % 100 == 0:
            l = loss.detach()
            dist.all_reduce(l, op=dist.ReduceOp.AVG)
            if rank == 0:
                print(f"step {step} loss {l.item():.4f} lr {sched.get_last_lr()[0]:.2e}")
        if step % 5000 == 0 and rank == 0:
            torch.save(model.module.state_dict(), f"stream_lm_{step}.pt")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
