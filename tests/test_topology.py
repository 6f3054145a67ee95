"""Mode selection as a table: launcher environment x hardware x overrides -> plan. No processes."""

from __future__ import annotations

import pytest

from ddpkit.cluster.environments import first_slurm_host
from ddpkit.cluster.topology import Hardware, detect_ranks, resolve, threads_per_process
from ddpkit.errors import DdpkitError

CPU = Hardware(gpus=0, cpu_cores=2)
ONE_GPU = Hardware(gpus=1, cpu_cores=16)
TWO_GPUS = Hardware(gpus=2, cpu_cores=32)
EIGHT_GPUS = Hardware(gpus=8, cpu_cores=96)


def torchrun(rank: int, world: int, local_rank: int | None = None, local_world: int | None = None) -> dict:
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"}
    env["LOCAL_RANK"] = str(rank if local_rank is None else local_rank)
    env["LOCAL_WORLD_SIZE"] = str(world if local_world is None else local_world)
    return env


def slurm(procid: int, ntasks: int, localid: int, nnodes: int = 1, **extra: str) -> dict:
    return {
        "SLURM_PROCID": str(procid),
        "SLURM_NTASKS": str(ntasks),
        "SLURM_LOCALID": str(localid),
        "SLURM_NNODES": str(nnodes),
        "SLURM_NODEID": str(procid // (ntasks // nnodes)),
        "SLURM_NODELIST": "gpu[07-08]",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "train",
        "SLURM_STEP_ID": "0",
        **extra,
    }


# (name, env, hardware, device override, expected mode, device, backend, rank, world)
TABLE = [
    ("plain python, CPU", {}, CPU, "auto", "single-cpu", "cpu", None, 0, 1),
    ("plain python, 1 GPU", {}, ONE_GPU, "auto", "single-gpu", "cuda:0", None, 0, 1),
    ("plain python, 8 GPUs: one device", {}, EIGHT_GPUS, "auto", "single-gpu", "cuda:0", None, 0, 1),
    ("plain python, GPU but --device cpu", {}, ONE_GPU, "cpu", "single-cpu", "cpu", None, 0, 1),
    ("torchrun 2 ranks, CPU", torchrun(1, 2), CPU, "auto", "ddp-cpu", "cpu", "gloo", 1, 2),
    ("torchrun 4 ranks on 2 cores", torchrun(3, 4), CPU, "auto", "ddp-cpu", "cpu", "gloo", 3, 4),
    ("torchrun 2 ranks, 2 GPUs", torchrun(1, 2), TWO_GPUS, "auto", "ddp-gpu", "cuda:1", "nccl", 1, 2),
    ("torchrun 2 GPUs forced to CPU", torchrun(1, 2), TWO_GPUS, "cpu", "ddp-cpu", "cpu", "gloo", 1, 2),
    ("torchrun world 1 with a GPU", torchrun(0, 1), ONE_GPU, "auto", "single-gpu", "cuda:0", None, 0, 1),
    (
        "2 nodes x 8 GPUs, node 1",
        torchrun(13, 16, 5, 8),
        EIGHT_GPUS,
        "auto",
        "ddp-gpu",
        "cuda:5",
        "nccl",
        13,
        16,
    ),
    ("slurm 4 tasks, 2 nodes", slurm(3, 4, 1, 2), TWO_GPUS, "auto", "ddp-gpu", "cuda:1", "nccl", 3, 4),
    ("slurm 2 tasks, CPU", slurm(1, 2, 1), CPU, "auto", "ddp-cpu", "cpu", "gloo", 1, 2),
    (
        "slurm interactive shell: alone",
        slurm(0, 2, 0, SLURM_JOB_NAME="bash"),
        CPU,
        "auto",
        "single-cpu",
        "cpu",
        None,
        0,
        1,
    ),
    ("slurm 1 task: alone", slurm(0, 1, 0), ONE_GPU, "auto", "single-gpu", "cuda:0", None, 0, 1),
    (
        "torchrun inside srun: torchrun wins",
        {**slurm(0, 1, 0), **torchrun(1, 2)},
        CPU,
        "auto",
        "ddp-cpu",
        "cpu",
        "gloo",
        1,
        2,
    ),
    (
        "DDPKIT_DEVICE=cpu from ddpkit run",
        {**torchrun(0, 2), "DDPKIT_DEVICE": "cpu"},
        TWO_GPUS,
        "auto",
        "ddp-cpu",
        "cpu",
        "gloo",
        0,
        2,
    ),
]


@pytest.mark.parametrize(("name", "env", "hw", "device", "mode", "dev", "backend", "rank", "world"), TABLE)
def test_plan_table(name, env, hw, device, mode, dev, backend, rank, world) -> None:
    plan = resolve(env, hw, device=device)
    assert (plan.mode, plan.device, plan.backend) == (mode, dev, backend), name
    assert (plan.ranks.rank, plan.ranks.world_size) == (rank, world), name
    assert plan.distributed == (world > 1)


def test_slurm_rendezvous_address_is_first_host_and_port_from_job_id() -> None:
    r = detect_ranks(slurm(1, 2, 1))
    assert (r.launcher, r.master_addr, r.master_port) == ("slurm", "gpu07", 15000 + 4242)
    assert (
        detect_ranks({**slurm(1, 2, 1), "MASTER_ADDR": "head", "MASTER_PORT": "1234"}).master_addr == "head"
    )


@pytest.mark.parametrize(
    ("nodelist", "host"),
    [("node01", "node01"), ("node[03-05,9]", "node03"), ("a[1,2],b3", "a1"), ("gpu-a[010-012]", "gpu-a010")],
)
def test_first_slurm_host(nodelist: str, host: str) -> None:
    assert first_slurm_host(nodelist) == host


CONTRADICTIONS = [
    (
        "4 ranks per node, 2 GPUs, NCCL",
        torchrun(1, 4),
        TWO_GPUS,
        {"backend": "nccl"},
        r"4 processes on this node.*only 2 GPU.*--nproc 2.*--device cpu",
    ),
    ("4 ranks per node, 2 GPUs, auto", torchrun(0, 4), TWO_GPUS, {}, r"NCCL needs one GPU per process"),
    ("cuda asked, no GPU", {}, CPU, {"device": "cuda"}, r"no visible GPU.*--device cpu"),
    ("nccl asked on CPU", torchrun(0, 2), CPU, {"backend": "nccl"}, r"'nccl' needs GPUs.*gloo"),
    ("rank outside world", {"RANK": "2", "WORLD_SIZE": "2"}, CPU, {}, r"rank 2 is outside world size 2"),
    (
        "world size not a number",
        {"RANK": "0", "WORLD_SIZE": "two"},
        CPU,
        {},
        r"WORLD_SIZE='two' is not an integer",
    ),
    (
        "LOCAL_RANK beyond GPUs",
        torchrun(0, 1, 0, 1) | {"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4"},
        TWO_GPUS,
        {"backend": "gloo"},
        r"LOCAL_RANK 3 but only 2 GPU",
    ),
    ("unknown device", {}, CPU, {"device": "tpu"}, r"device='tpu' is not one of"),
    (
        "more ranks than GPUs names --share-gpu",
        torchrun(2, 3),
        ONE_GPU,
        {},
        r"3 processes.*only 1 GPU.*--nproc 1.*--share-gpu.*--device cpu",
    ),
    (
        "LOCAL_RANK beyond GPUs names the fix",
        torchrun(0, 1, 0, 1) | {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
        ONE_GPU,
        {"backend": "gloo"},
        r"LOCAL_RANK 1 but only 1 GPU.*--nproc auto.*CUDA_VISIBLE_DEVICES.*--share-gpu",
    ),
    (
        "share_gpu without a GPU",
        torchrun(0, 2),
        CPU,
        {"share_gpu": True},
        r"share_gpu=True.*no visible GPU.*Drop --share-gpu",
    ),
    (
        "share_gpu with --device cpu",
        torchrun(0, 2),
        ONE_GPU,
        {"share_gpu": True, "device": "cpu"},
        r"device='cpu' was asked",
    ),
    (
        "share_gpu with nccl",
        torchrun(0, 2),
        ONE_GPU,
        {"share_gpu": True, "backend": "nccl"},
        r"Duplicate GPU detected.*backend='auto'",
    ),
]


@pytest.mark.parametrize(("name", "env", "hw", "kwargs", "message"), CONTRADICTIONS)
def test_contradictions_are_clear_errors(name, env, hw, kwargs, message) -> None:
    with pytest.raises(DdpkitError, match=message):
        resolve(env, hw, **kwargs)


@pytest.mark.parametrize(
    ("cores", "nproc", "threads"), [(2, 1, 2), (2, 2, 1), (2, 4, 1), (16, 3, 5), (1, 1, 1)]
)
def test_threads_per_process(cores: int, nproc: int, threads: int) -> None:
    assert threads_per_process(cores, nproc) == threads


# (name, env, hardware, expected device, backend, shared); all with share_gpu=True
SHARED = [
    ("2 ranks, 1 GPU", torchrun(1, 2), ONE_GPU, "cuda:0", "gloo", True),
    ("3 ranks, 2 GPUs: round-robin", torchrun(2, 3), TWO_GPUS, "cuda:0", "gloo", True),
    ("3 ranks, 2 GPUs, local rank 1", torchrun(1, 3), TWO_GPUS, "cuda:1", "gloo", True),
    ("2 ranks, 2 GPUs: nothing to share, NCCL", torchrun(1, 2), TWO_GPUS, "cuda:1", "nccl", False),
    ("1 process: plain single GPU", {}, ONE_GPU, "cuda:0", None, False),
    (
        "DDPKIT_SHARE_GPU=1 from ddpkit run",
        {**torchrun(1, 2), "DDPKIT_SHARE_GPU": "1"},
        ONE_GPU,
        "cuda:0",
        "gloo",
        True,
    ),
]


@pytest.mark.parametrize(("name", "env", "hw", "dev", "backend", "shared"), SHARED)
def test_share_gpu_places_ranks_round_robin_over_gloo(name, env, hw, dev, backend, shared) -> None:
    plan = resolve(env, hw, share_gpu="DDPKIT_SHARE_GPU" not in env)
    assert (plan.device, plan.backend, plan.shared_gpu) == (dev, backend, shared), name
    assert plan.mode == ("ddp-gpu" if plan.distributed else "single-gpu")
    if shared:
        assert any("correctness, not for speed" in n for n in plan.notes)
        assert "sharing the GPU" in plan.describe()


def test_share_gpu_is_opt_in() -> None:
    with pytest.raises(DdpkitError, match="NCCL needs one GPU per process"):
        resolve(torchrun(1, 2), ONE_GPU)
    assert resolve({**torchrun(1, 2), "DDPKIT_SHARE_GPU": "0"}, ONE_GPU, device="cpu").mode == "ddp-cpu"
