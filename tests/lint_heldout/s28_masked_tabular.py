"""Self-supervised masked-feature pretraining for tabular data.

Works both single-GPU (python s28_masked_tabular.py) and multi-GPU (torchrun ...).
The dataset file is pre-shuffled offline, so the sampler does not shuffle; the random
feature masks give each rank different views instead.
"""
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

SEED = 31337
MASK_P = 0.3
EPOCHS = 40
BATCH = 2048

ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    dist.init_process_group(backend="nccl")
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    device = f"cuda:{local_rank}"
    torch.cuda.set_device(device)
else:
    rank, local_rank, world_size, device = 0, 0, 1, "cuda"
master_process = rank == 0

torch.manual_seed(SEED)

blob = torch.load("tabular_shuffled.pt")
X = blob["x"].float()
ds = TensorDataset(X)
sampler = DistributedSampler(ds, shuffle=False) if ddp else None
loader = DataLoader(ds, batch_size=BATCH, sampler=sampler, shuffle=False, num_workers=2, drop_last=True)


class MaskedAE(nn.Module):
    def __init__(self, d, hidden=512):
        super().__init__()
        self.mask_token = nn.Parameter(torch.zeros(d))
        self.enc = nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Dropout(0.1),
                                 nn.Linear(hidden, hidden), nn.GELU())
        self.dec = nn.Linear(hidden, d)

    def forward(self, x, mask):
        x_in = torch.where(mask, self.mask_token.expand_as(x), x)
        return self.dec(self.enc(x_in))


model = MaskedAE(X.shape[1]).to(device)
if ddp:
    model = DDP(model, device_ids=[local_rank])

# parameters are identical on all ranks now; decorrelate masks/dropout across ranks
torch.manual_seed(SEED + rank)

optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-4)

for epoch in range(EPOCHS):
    t0 = time.time()
    tot = torch.zeros(2, device=device)
    for (xb,) in loader:
        xb = xb.to(device, non_blocking=True)
        mask = torch.rand_like(xb) < MASK_P
        recon = model(xb, mask)
        loss = F.mse_loss(recon[mask], xb[mask])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        tot += torch.stack([loss.detach(), torch.ones((), device=device)])
    if ddp:
        dist.all_reduce(tot)
    if master_process:
        print(f"epoch {epoch:3d} masked mse {(tot[0] / tot[1]).item():.5f} ({time.time() - t0:.1f}s)")

if master_process:
    raw = model.module if ddp else model
    torch.save(raw.enc.state_dict(), "masked_ae_encoder.pt")
if ddp:
    dist.destroy_process_group()
