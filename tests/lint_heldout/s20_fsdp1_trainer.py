"""T5-style encoder-decoder summarisation fine-tune with FSDP (torch.distributed.fsdp.FullyShardedDataParallel)."""
import os
import functools

import torch
import torch.distributed as dist
from torch.distributed.fsdp import (
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
    FullStateDictConfig,
)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, DistributedSampler
from transformers import T5ForConditionalGeneration
from transformers.models.t5.modeling_t5 import T5Block

from summ_data import load_summarisation  # project-local


class FSDPTrainer:
    def __init__(self, model_name, train_ds, lr=1e-4, batch_size=8):
        self.rank = dist.get_rank()
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.model = T5ForConditionalGeneration.from_pretrained(model_name)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.sampler = DistributedSampler(train_ds, shuffle=True)
        self.loader = DataLoader(train_ds, batch_size=batch_size, sampler=self.sampler,
                                 collate_fn=train_ds.collate, num_workers=2)
        self._shard()

    def _shard(self):
        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={T5Block})
        bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                              buffer_dtype=torch.bfloat16)
        self.model = FSDP(
            self.model,
            auto_wrap_policy=policy,
            mixed_precision=bf16,
            sharding_strategy=ShardingStrategy.FULL_SHARD,
            device_id=torch.cuda.current_device(),
        )

    def train_epoch(self, epoch):
        self.model.train()
        self.sampler.set_epoch(epoch)
        stats = torch.zeros(2, device=self.local_rank)
        for batch in self.loader:
            batch = {k: v.to(self.local_rank) for k, v in batch.items()}
            out = self.model(**batch)
            self.optimizer.zero_grad()
            out.loss.backward()
            self.model.clip_grad_norm_(1.0)
            self.optimizer.step()
            stats[0] += out.loss.detach()
            stats[1] += 1
        dist.all_reduce(stats)
        return (stats[0] / stats[1]).item()

    def save(self, path):
        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(self.model, StateDictType.FULL_STATE_DICT, cfg):
            state = self.model.state_dict()
        if self.rank == 0:
            torch.save(state, path)

    def fit(self, epochs):
        for epoch in range(epochs):
            loss = self.train_epoch(epoch)
            if self.rank == 0:
                print(f"epoch {epoch} loss {loss:.4f}")
            self.save(f"t5_summ_epoch{epoch}.pt")


def main():
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.manual_seed(0)
    train_ds = load_summarisation("cnn_dailymail", split="train", max_src=512, max_tgt=128)
    trainer = FSDPTrainer("t5-base", train_ds)
    trainer.fit(epochs=3)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
