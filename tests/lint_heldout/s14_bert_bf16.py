"""Sentence classification fine-tuning (BERT-base) with DDP, with an optional low-memory mode."""
import os
import argparse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoTokenizer, AutoModelForSequenceClassification, get_linear_schedule_with_warmup
from datasets import load_dataset


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bert-base-uncased")
    ap.add_argument("--task", default="sst2")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--bs", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="bf16")
    return ap.parse_args()


def encode(tok, split):
    raw = load_dataset("glue", "sst2", split=split)
    enc = raw.map(lambda b: tok(b["sentence"], truncation=True, padding="max_length", max_length=128),
                  batched=True)
    enc.set_format("torch", columns=["input_ids", "attention_mask", "label"])
    return enc


def main():
    args = parse()
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    is_master = dist.get_rank() == 0
    torch.manual_seed(42)

    tok = AutoTokenizer.from_pretrained(args.model)
    train = encode(tok, "train")
    sampler = DistributedSampler(train, shuffle=True)
    loader = DataLoader(train, batch_size=args.bs, sampler=sampler, num_workers=2)

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.precision]
    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=2)
    model = model.to(device=f"cuda:{local_rank}", dtype=dtype)
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = len(loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.06 * total), total)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        running, n = 0.0, 0
        for batch in loader:
            batch = {k: v.cuda(local_rank, non_blocking=True) for k, v in batch.items()}
            out = model(input_ids=batch["input_ids"],
                        attention_mask=batch["attention_mask"],
                        labels=batch["label"])
            out.loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            running += out.loss.item()
            n += 1
        stat = torch.tensor([running, n], device=local_rank, dtype=torch.float64)
        dist.all_reduce(stat)
        if is_master:
            print(f"epoch {epoch}: mean train loss {stat[0].item() / stat[1].item():.4f}")

    if is_master:
        model.module.save_pretrained("bert_sst2")
        tok.save_pretrained("bert_sst2")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
