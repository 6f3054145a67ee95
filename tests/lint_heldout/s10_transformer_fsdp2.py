"""Supervised fine-tuning with FSDP2 (per-block fully_shard) on a packed instruction dataset."""
import os
import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.checkpoint.state_dict import get_state_dict, StateDictOptions
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM
from datasets import load_from_disk


@dataclass
class Config:
    model_name: str = "meta-llama/Llama-3.2-1B"
    data_path: str = "data/sft_packed"
    epochs: int = 2
    micro_bs: int = 4
    lr: float = 2e-5
    out: str = "sft_out"


def collate(batch):
    ids = torch.tensor([b["input_ids"] for b in batch])
    labels = torch.tensor([b["labels"] for b in batch])
    return ids, labels


def prepare_epoch(loader, epoch):
    sampler = loader.sampler
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)
    return iter(loader)


def apply_fsdp(model, mesh):
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    shard = functools.partial(fully_shard, mesh=mesh, mp_policy=policy)
    for block in model.model.layers:
        shard(block)
    shard(model)


def main(cfg: Config):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    torch.manual_seed(0)

    ds = load_from_disk(cfg.data_path)
    loader = DataLoader(ds, batch_size=cfg.micro_bs, collate_fn=collate,
                        sampler=DistributedSampler(ds, shuffle=True, seed=0), num_workers=2)

    model = AutoModelForCausalLM.from_pretrained(cfg.model_name, torch_dtype=torch.float32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.to("cuda")
    apply_fsdp(model, mesh)

    optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)

    for epoch in range(cfg.epochs):
        model.train()
        for step, (ids, labels) in enumerate(prepare_epoch(loader, epoch)):
            ids, labels = ids.cuda(), labels.cuda()
            logits = model(input_ids=ids).logits.float()
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                   ignore_index=-100)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            optim.zero_grad()
            if step % 20 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} step {step} loss {l.item():.4f}")

    # every rank takes part in the gather; only rank 0 writes
    model_sd, _ = get_state_dict(model, optim,
                                 options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        os.makedirs(cfg.out, exist_ok=True)
        torch.save(model_sd, os.path.join(cfg.out, "model.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Config())
