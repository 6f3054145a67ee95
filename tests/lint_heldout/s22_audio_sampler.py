"""Keyword-spotting (Speech Commands v2) with a 1-D conv net; config-dict driven, torchrun launch."""
import os
import yaml

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

DEFAULTS = {
    "root": "/data/speech_commands",
    "epochs": 60,
    "batch_size": 256,
    "lr": 3e-3,
    "seed": 1,
    "n_mels": 40,
}


class KWSNet(nn.Module):
    def __init__(self, n_mels, n_classes=35, ch=128):
        super().__init__()
        layers, c_in = [], n_mels
        for dilation in (1, 2, 4, 8):
            layers += [nn.Conv1d(c_in, ch, 3, padding=dilation, dilation=dilation),
                       nn.GroupNorm(8, ch), nn.GELU()]
            c_in = ch
        self.body = nn.Sequential(*layers)
        self.fc = nn.Linear(ch, n_classes)

    def forward(self, mel):
        return self.fc(self.body(mel).mean(-1))


class MelWrap(torch.utils.data.Dataset):
    def __init__(self, base, n_mels):
        self.base = base
        self.labels = sorted({item[2] for item in base})
        self.mel = torchaudio.transforms.MelSpectrogram(16000, n_mels=n_mels)

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        wav, sr, label, *_ = self.base[i]
        wav = F.pad(wav, (0, 16000 - wav.shape[-1]))
        return self.mel(wav).squeeze(0).clamp(min=1e-6).log(), self.labels.index(label)


def build_loader(cfg, rank, world):
    base = torchaudio.datasets.SPEECHCOMMANDS(cfg["root"], subset="training", download=False)
    ds = MelWrap(base, cfg["n_mels"])
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=cfg["seed"])
    return DataLoader(ds, batch_size=cfg["batch_size"], sampler=sampler,
                      num_workers=8, pin_memory=True, drop_last=True)


def main():
    cfg = dict(DEFAULTS)
    if os.path.exists("kws.yaml"):
        cfg.update(yaml.safe_load(open("kws.yaml")))

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    torch.manual_seed(cfg["seed"])

    loader = build_loader(cfg, rank, world)
    model = KWSNet(cfg["n_mels"]).cuda()
    model = DDP(model, device_ids=[local])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg["lr"],
                                                total_steps=cfg["epochs"] * len(loader))

    for epoch in range(cfg["epochs"]):
        model.train()
        m = torch.zeros(3, device="cuda")
        for mel, y in loader:
            mel, y = mel.cuda(non_blocking=True), y.cuda(non_blocking=True)
            logits = model(mel)
            loss = F.cross_entropy(logits, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            m += torch.stack([loss.detach() * y.numel(), (logits.argmax(-1) == y).sum().float(),
                              torch.tensor(float(y.numel()), device="cuda")])
        dist.all_reduce(m)
        if rank == 0:
            print(f"[{epoch:02d}] loss {m[0] / m[2]:.4f} acc {m[1] / m[2]:.4f}")
            torch.save(model.module.state_dict(), "kws.pt")

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
