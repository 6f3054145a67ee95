"""Launcher detection as a table: one environment per row -> who this process is. No processes."""

from __future__ import annotations

import pytest

from ddpkit.cluster import environments
from ddpkit.cluster.environments import DETECTORS, detect, tasks_on_node
from ddpkit.cluster.topology import Hardware, resolve
from ddpkit.errors import DdpkitError

MASTER = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"}
TORCHRUN = {
    "RANK": "5",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "4",
    "GROUP_RANK": "1",
    **MASTER,
}
POD = {"RANK": "3", "WORLD_SIZE": "4", **MASTER, "KUBERNETES_SERVICE_HOST": "10.96.0.1"}
# The batch script of `sbatch --ntasks=4 --nodes=2`: Slurm sets PROCID/LOCALID/NODEID=0 but starts no step.
SBATCH = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NAME": "train",
    "SLURM_NTASKS": "4",
    "SLURM_NNODES": "2",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
    "SLURM_NODELIST": "gpu[07-08]",
    "SLURM_TASKS_PER_NODE": "2(x2)",
}
# Task 3 of `srun` inside that script: the step's variables come on top of the batch script's.
SRUN = {
    **SBATCH,
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    "SLURM_STEP_NODELIST": "gpu[07-08]",
}
OMPI = {
    "OMPI_COMM_WORLD_RANK": "5",
    "OMPI_COMM_WORLD_SIZE": "6",
    "OMPI_COMM_WORLD_LOCAL_RANK": "2",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "3",
    "MASTER_ADDR": "host0",
}
HYDRA = {
    "PMI_RANK": "2",
    "PMI_SIZE": "4",
    "MPI_LOCALRANKID": "0",
    "MPI_LOCALNRANKS": "2",
    "MASTER_ADDR": "h0",
}

# (name, env, launcher, rank, world, local rank, local world, node rank, master address)
TABLE = [
    ("plain python", {}, "none", 0, 1, 0, 1, 0, "127.0.0.1"),
    ("torchrun, node 1", TORCHRUN, "torchrun", 5, 8, 1, 4, 1, "10.0.0.1"),
    ("torchrun in a pod wins", {**POD, **TORCHRUN}, "torchrun", 5, 8, 1, 4, 1, "10.0.0.1"),
    ("torchrun inside srun wins", {**SRUN, **TORCHRUN}, "torchrun", 5, 8, 1, 4, 1, "10.0.0.1"),
    ("PyTorchJob pod: one process per pod", POD, "pytorchjob", 3, 4, 0, 1, 3, "10.0.0.1"),
    (
        "RANK/WORLD_SIZE by hand: one machine",
        {"RANK": "2", "WORLD_SIZE": "3"},
        "env",
        2,
        3,
        2,
        3,
        0,
        "127.0.0.1",
    ),
    (
        "by hand with LOCAL_WORLD_SIZE",
        {"RANK": "5", "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "2", **MASTER},
        "env",
        5,
        6,
        1,
        2,
        2,
        "10.0.0.1",
    ),
    ("Open MPI", OMPI, "mpi", 5, 6, 2, 3, 1, "host0"),
    ("MPICH / Intel MPI (hydra)", HYDRA, "mpi", 2, 4, 0, 2, 1, "h0"),
    ("mpirun inside sbatch: MPI wins", {**SBATCH, **OMPI}, "mpi", 5, 6, 2, 3, 1, "host0"),
    ("srun task 3 of 4", SRUN, "slurm", 3, 4, 1, 2, 1, "gpu07"),
    (
        "srun, old SLURM_STEPID",
        {**{k: v for k, v in SRUN.items() if k != "SLURM_STEP_ID"}, "SLURM_STEPID": "0"},
        "slurm",
        3,
        4,
        1,
        2,
        1,
        "gpu07",
    ),
    (
        "srun --mpi=pmi2: Slurm knows the local ranks",
        {**SRUN, "PMI_RANK": "3", "PMI_SIZE": "4"},
        "slurm",
        3,
        4,
        1,
        2,
        1,
        "gpu07",
    ),
    (
        "srun uneven tasks per node",
        {**SRUN, "SLURM_STEP_TASKS_PER_NODE": "1,3", "SLURM_LOCALID": "2"},
        "slurm",
        3,
        4,
        2,
        3,
        1,
        "gpu07",
    ),
    (
        "srun, 1 task",
        {
            **SRUN,
            "SLURM_PROCID": "0",
            "SLURM_LOCALID": "0",
            "SLURM_NODEID": "0",
            "SLURM_STEP_NUM_TASKS": "1",
            "SLURM_STEP_TASKS_PER_NODE": "1",
        },
        "slurm",
        0,
        1,
        0,
        1,
        0,
        "gpu07",
    ),
    ("THE TRAP: the sbatch script itself", SBATCH, "slurm-batch", 0, 1, 0, 1, 0, "127.0.0.1"),
    ("sbatch with 1 task: plain", {**SBATCH, "SLURM_NTASKS": "1"}, "none", 0, 1, 0, 1, 0, "127.0.0.1"),
    (
        "job named interactive: plain",
        {**SRUN, "SLURM_JOB_NAME": "interactive"},
        "none",
        0,
        1,
        0,
        1,
        0,
        "127.0.0.1",
    ),
]


@pytest.mark.parametrize(
    ("name", "env", "launcher", "rank", "world", "lrank", "lworld", "node", "addr"), TABLE
)
def test_detect_table(name, env, launcher, rank, world, lrank, lworld, node, addr) -> None:
    r = detect(env)
    assert r.launcher == launcher, name
    assert (r.rank, r.world_size, r.local_rank, r.local_world_size, r.node_rank) == (
        rank,
        world,
        lrank,
        lworld,
        node,
    ), name
    assert r.master_addr == addr, name


def test_sbatch_trap_trains_alone_and_says_to_type_srun() -> None:
    plan = resolve(SBATCH, Hardware(gpus=1, cpu_cores=16))
    assert (plan.mode, plan.ranks.world_size, plan.backend) == ("single-gpu", 1, None)
    (note,) = plan.notes
    assert "SLURM_NTASKS=4" in note and "not started by srun" in note and "`srun python train.py`" in note
    assert "3 rank(s) that would never start" in note
    srun = resolve(SRUN, Hardware(gpus=2, cpu_cores=32))
    assert (srun.mode, srun.device, srun.notes) == ("ddp-gpu", "cuda:1", ())


def test_slurm_port_from_job_id_unless_given() -> None:
    assert detect(SRUN).master_port == 15000 + 4242
    r = detect({**SRUN, "MASTER_ADDR": "head", "MASTER_PORT": "1234"})
    assert (r.master_addr, r.master_port) == ("head", 1234)


def test_mpirun_over_machines_without_master_addr_is_a_clear_error() -> None:
    with pytest.raises(DdpkitError, match=r"6 ranks over several machines.*mpirun -x MASTER_ADDR="):
        detect({k: v for k, v in OMPI.items() if k != "MASTER_ADDR"})


def test_priority_order_is_stated_and_plain_is_last() -> None:
    names = [d.__name__ for d in DETECTORS]
    assert names == ["torchrun", "pytorchjob", "env_vars", "mpi", "slurm", "slurm_batch", "plain"]
    assert all(d({}) is None for d in DETECTORS[:-1])


@pytest.mark.parametrize(
    ("spec", "node", "tasks"),
    [("4", 0, 4), ("2(x3),1", 2, 2), ("2(x3),1", 3, 1), ("2(x3)", 5, None), ("junk", 0, None)],
)
def test_tasks_on_node(spec: str, node: int, tasks: int | None) -> None:
    assert tasks_on_node(spec, node) == tasks


def test_describe_names_the_launcher() -> None:
    assert "PyTorchJob" in environments.describe(detect(POD))
    assert "rank 3 of 4, local rank 1 of 2, node 1" in environments.describe(detect(SRUN))
    assert "not started by srun" in environments.describe(detect(SBATCH))
