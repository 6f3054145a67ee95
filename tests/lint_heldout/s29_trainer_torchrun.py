"""Trainer-class DDP job (torchrun) for a deep point-cloud classifier (PointNet-style) on ModelNet40."""
import os
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed import init_process_group, destroy_process_group, get_rank, all_reduce
from torch.utils.checkpoint import checkpoint

from modelnet import ModelNet40  # project-local

ckpt_fn = partial(checkpoint, use_reentrant=False)


class SharedMLP(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, 1)
        self.bn = nn.BatchNorm1d(cout)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


class PointNet(nn.Module):
    def __init__(self, n_classes=40, use_ckpt=True):
        super().__init__()
        self.layers = nn.ModuleList([SharedMLP(3, 64), SharedMLP(64, 128), SharedMLP(128, 1024)])
        self.head = nn.Sequential(nn.Linear(1024, 512), nn.ReLU(), nn.Dropout(0.4), nn.Linear(512, n_classes))
        self.use_ckpt = use_ckpt

    def forward(self, pts):
        x = pts.transpose(1, 2)
        for layer in self.layers:
            x = ckpt_fn(layer, x) if self.use_ckpt else layer(x)
        return self.head(x.max(dim=2).values)


def prepare_model(model, device_id):
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return DDP(model.to(device_id), device_ids=[device_id])


class Trainer:
    def __init__(self, model, train_data, make_optimizer, save_every, snapshot_path="pointnet.pt"):
        self.gpu_id = int(os.environ["LOCAL_RANK"])
        self.global_rank = get_rank()
        self.model = prepare_model(model, self.gpu_id)
        self.train_data = train_data
        self.optimizer = make_optimizer(self.model.parameters())
        self.save_every = save_every
        self.snapshot_path = snapshot_path

    def _run_batch(self, pts, targets):
        self.optimizer.zero_grad()
        loss = F.cross_entropy(self.model(pts), targets, label_smoothing=0.2)
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def _run_epoch(self, epoch):
        self.train_data.sampler.set_epoch(epoch)
        total = torch.zeros(2, device=self.gpu_id)
        for pts, targets in self.train_data:
            pts, targets = pts.to(self.gpu_id), targets.to(self.gpu_id)
            total[0] += self._run_batch(pts, targets)
            total[1] += 1
        all_reduce(total)
        return (total[0] / total[1]).item()

    def _save_checkpoint(self, epoch):
        torch.save(self.model.module.state_dict(), self.snapshot_path)
        print(f"Epoch {epoch} | checkpoint saved at {self.snapshot_path}")

    def train(self, max_epochs):
        for epoch in range(max_epochs):
            loss = self._run_epoch(epoch)
            if self.global_rank != 0:
                continue
            print(f"[GPU{self.global_rank}] Epoch {epoch} | loss {loss:.4f}")
            if epoch % self.save_every == 0:
                self._save_checkpoint(epoch)


def main(total_epochs=200, save_every=10, batch_size=32):
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    init_process_group(backend="nccl")
    torch.manual_seed(0)
    ds = ModelNet40("/data/modelnet40", split="train", n_points=1024)
    loader = DataLoader(ds, batch_size=batch_size, pin_memory=True, shuffle=False,
                        sampler=DistributedSampler(ds), num_workers=4, drop_last=True)
    model = PointNet()
    make_optimizer = partial(torch.optim.Adam, lr=1e-3, weight_decay=1e-4)
    Trainer(model, loader, make_optimizer, save_every).train(total_epochs)
    destroy_process_group()


if __name__ == "__main__":
    main()
