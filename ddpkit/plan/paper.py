"""The DDP paper's setting, replayed by the planner (docs/planning.md, "Against published figures").

Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training", VLDB 2020,
evaluate ResNet-50 and BERT on servers of 8 V100 GPUs joined by NVLink inside a server and one
100 Gb/s NIC per server, with DDP's default 25 MB buckets, up to 256 GPUs. Neither V100s nor the
paper's code are here, so this module keeps what can be kept: the models' real parameter lists and
the order and timing of their gradients in backward (profiled on this CPU), scaled so that a step
takes what a V100 takes (`V100_STEP_S`, an assumption stated in the docs), over that link.

    python -m ddpkit.plan.paper [profiles.json]   # profile both models (~1 minute; or reuse the file)
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from ddpkit.plan import links
from ddpkit.plan.planner import Planner
from ddpkit.plan.profile import Profile
from ddpkit.plan.simulate import Options
from ddpkit.tools import workloads

# A V100's fp32 step at 32 samples per GPU (assumed from commonly published throughputs: ResNet-50
# ~375 images/s, BERT-base at sequence 128 ~160 sequences/s); the optimizer step is scaled alike.
V100_STEP_S = {"resnet50": 0.085, "bert": 0.200}
PAPER_BATCH = 32
COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def paper_link() -> links.Link:
    """8 V100s per server on NVLink 2 (6 links x 25 GB/s per direction), one 100 Gb/s NIC per server."""
    nvlink2 = links.Level(
        name="NVLink 2 (V100)",
        alpha_s=1e-6,
        beta_Bps=150e9 * links.EFFICIENCY,
        source="6 NVLinks x 25 GB/s per direction (NVIDIA V100 datasheet) x 80% (assumed)",
    )
    nic = links.Level(
        name="100 Gb/s NIC",
        alpha_s=5e-6,
        beta_Bps=12.5e9 * links.EFFICIENCY,
        source="one 100 Gb/s NIC per server, as the paper describes its cluster, x 80% (assumed)",
    )
    return links.Link(
        name="paper: 8 x V100 + 1 x 100 Gb/s per server",
        intra=nvlink2,
        inter=nic,
        nics_per_node=1,
        launch_s=links.LAUNCH_S,
    )


class Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * 4
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, width, 3, stride, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, cout, 1, bias=False),
            nn.BatchNorm2d(cout),
        )
        self.down = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.down(x))


def resnet50() -> nn.Module:
    """ResNet-50 (He et al. 2016; torchvision's layout, 25.6M parameters)."""
    layers: list[nn.Module] = [
        nn.Conv2d(3, 64, 7, 2, 3, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.MaxPool2d(3, 2, 1),
    ]
    cin = 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(blocks):
            layers.append(Bottleneck(cin, width, stride if i == 0 else 1))
            cin = width * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2048, 1000)]
    return nn.Sequential(*layers)


class Bert(nn.Module):
    """BERT-base's encoder (Devlin et al. 2019: 12 layers, 768 wide, 12 heads; 110M parameters with
    the 30522-token embedding), with a classifier on the first token."""

    def __init__(self, vocab: int = 30522, seq: int = 128, d: int = 768, layers: int = 12) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(512, d)
        self.ln = nn.LayerNorm(d)
        layer = nn.TransformerEncoderLayer(d, 12, 4 * d, dropout=0.0, activation="gelu", batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.pool, self.head = nn.Linear(d, d), nn.Linear(d, 2)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        h = self.encoder(self.ln(self.tok(idx) + self.pos(pos)))
        return self.head(torch.tanh(self.pool(h[:, 0])))


def _images(g: torch.Generator, n: int) -> workloads.Batch:
    return torch.randn(n, 3, 224, 224, generator=g), torch.randint(0, 1000, (n,), generator=g)


def _tokens(g: torch.Generator, n: int) -> workloads.Batch:
    return torch.randint(0, 30522, (n, 128), generator=g), torch.randint(0, 2, (n,), generator=g)


def resnet50_workload() -> workloads.Workload:
    return workloads.Workload(
        name="resnet50",
        build=resnet50,
        sample=_images,
        global_batch=PAPER_BATCH,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    )


def bert_workload() -> workloads.Workload:
    return workloads.Workload(
        name="bert",
        build=Bert,
        sample=_tokens,
        global_batch=PAPER_BATCH,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4),
    )


def planner_for(name: str, cpu_profile: Profile) -> Planner:
    """Scale a CPU profile so that forward + backward take a V100's time at 32 samples."""
    scale = V100_STEP_S[name] / (cpu_profile.forward_s + cpu_profile.backward_s)
    target = replace(cpu_profile.scaled(scale), batch=PAPER_BATCH)
    return Planner(
        profiles={PAPER_BATCH: target},
        link=paper_link(),
        per_node=8,
        batches=dict.fromkeys(COUNTS, PAPER_BATCH),
    )


def cpu_profiles(path: str | None, batch: int = 2, threads: int = 2) -> dict[str, Profile]:
    """Both models profiled on this CPU at a small batch; read from / written to `path` when given."""
    from ddpkit.plan import profile

    if path and os.path.exists(path):
        with open(path) as f:
            return {k: Profile.from_dict(v) for k, v in json.load(f).items()}
    out = {
        name: profile.measure(
            f"ddpkit.plan.paper:{name}_workload", [batch], threads=threads, steps=3, warmup=2
        )[batch]
        for name in V100_STEP_S
    }
    if path:
        with open(path, "w") as f:
            json.dump({k: v.as_dict() for k, v in out.items()}, f)
    return out


def report(name: str, pl: Planner) -> list[str]:
    from ddpkit.bench.report import table

    curve = pl.curve(list(COUNTS), Options())
    p = pl.profile_at(PAPER_BATCH)
    lines = [
        f"{name}: {p.param_bytes / 1e6:.1f} MB of gradients, {len(p.buckets())} buckets of 25 MB, "
        f"V100 step {p.compute_s * 1e3:.0f} ms (forward {p.forward_s * 1e3:.0f}, "
        f"backward {p.backward_s * 1e3:.0f})"
    ]
    rows = []
    for q in curve:
        serial = q.step_s + (q.comm_s - q.exposed_s)  # the same step with no overlap at all
        rows.append(
            [q.n, q.step_s * 1e3, q.exposed_s * 1e3, q.comm_s * 1e3, serial * 1e3, f"{q.efficiency:.3f}"]
        )
    lines.append(
        table(["GPUs", "step ms", "exposed ms", "comm ms", "no-overlap step ms", "efficiency"], rows)
    )
    sweep = pl.bucket_sweep(32, Options())
    lines.append(
        table(
            ["bucket MB at 32 GPUs", "step ms"],
            [[f"{q.options['bucket_cap_mb']:g}", q.step_s * 1e3] for q in sweep],
        )
    )
    return lines


def main(argv: list[str]) -> int:
    profiles = cpu_profiles(argv[0] if argv else None)
    for name, p in profiles.items():
        print("\n".join(report(name, planner_for(name, p))))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
