"""DDP example with mp.spawn: small convnet with batch norm on MNIST."""
import os
import sys
import tempfile

import torch
import torch.nn as nn
import torch.optim as optim
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def setup(rank, world_size):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "12355"
    dist.init_process_group("nccl", rank=rank, world_size=world_size)


def cleanup():
    dist.destroy_process_group()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(1, 32, 3), nn.BatchNorm2d(32), nn.ReLU(),
            nn.Conv2d(32, 64, 3), nn.BatchNorm2d(64), nn.ReLU(),
            nn.MaxPool2d(2), nn.Flatten(),
            nn.Linear(9216, 128), nn.ReLU(), nn.Linear(128, 10),
        )

    def forward(self, x):
        return self.body(x)


def is_main(rank):
    return rank == 0


def save_if_main(rank, module, path):
    if not is_main(rank):
        return
    torch.save(module.state_dict(), path)
    print(f"saved checkpoint to {path}")


def start_epoch(loader, epoch):
    if isinstance(loader.sampler, DistributedSampler):
        loader.sampler.set_epoch(epoch)


def demo_basic(rank, world_size, epochs=5):
    print(f"Running basic DDP example on rank {rank}.")
    setup(rank, world_size)
    torch.cuda.set_device(rank)
    torch.manual_seed(0)

    ds = datasets.MNIST("./data", train=True, download=False,
                        transform=transforms.ToTensor())
    loader = DataLoader(ds, batch_size=64,
                        sampler=DistributedSampler(ds, num_replicas=world_size, rank=rank),
                        num_workers=2)

    net = Net()
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    net = net.to(rank)
    ddp_model = DDP(net, device_ids=[rank])

    loss_fn = nn.CrossEntropyLoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.01, momentum=0.9)

    ckpt = os.path.join(tempfile.gettempdir(), "mnist_ddp.checkpoint")
    for epoch in range(epochs):
        start_epoch(loader, epoch)
        total = torch.zeros(2, device=rank)
        for x, y in loader:
            x, y = x.to(rank), y.to(rank)
            optimizer.zero_grad()
            loss = loss_fn(ddp_model(x), y)
            loss.backward()
            optimizer.step()
            total += torch.stack([loss.detach() * len(y), torch.tensor(float(len(y)), device=rank)])
        dist.all_reduce(total)
        if is_main(rank):
            print(f"epoch {epoch} mean loss {(total[0] / total[1]).item():.4f}")
        save_if_main(rank, ddp_model.module, ckpt)

    cleanup()


def run_demo(demo_fn, world_size):
    mp.spawn(demo_fn, args=(world_size,), nprocs=world_size, join=True)


if __name__ == "__main__":
    n_gpus = torch.cuda.device_count()
    if n_gpus < 2:
        print(f"Requires at least 2 GPUs to run, but got {n_gpus}")
        sys.exit(0)
    run_demo(demo_basic, n_gpus)
