"""Launcher environments: one small pure `detect(env)` function per launcher, tried in a fixed order.

Each function reads a mapping of environment variables and returns the `RankEnv` it describes, or None
when the environment is not its launcher. `detect` tries them in the order of `DETECTORS`; the first
answer wins; detectors of your own (the `Detector` protocol, `ddpkit.session(launcher=...)`) are
tried first. `ddpkit.cluster.topology` turns the answer into a plan, and `ddpkit doctor` shows it.

    torchrun / ddpkit run      RANK, WORLD_SIZE, LOCAL_RANK (+ LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_*)
    Kubernetes PyTorchJob      RANK, WORLD_SIZE, MASTER_ADDR/PORT in a pod, no LOCAL_*: one process a pod
    env:// by hand             RANK, WORLD_SIZE without LOCAL_RANK, outside Kubernetes: one machine
    mpirun                     OMPI_COMM_WORLD_* (Open MPI) or PMI_RANK/PMI_SIZE (MPICH, Intel MPI)
    srun                       SLURM_PROCID and a job step (SLURM_STEP_ID), SLURM_NTASKS tasks
    sbatch script itself       SLURM_PROCID, SLURM_NTASKS > 1, but no job step: ONE process, warned
    plain python               nothing: one process

The Slurm trap: inside an `sbatch` script, before any `srun`, Slurm already sets SLURM_PROCID=0 and
SLURM_NTASKS=N (the allocation). A process started there is alone; joining a group of N would wait
for N-1 ranks that never start (Lightning's known hang). Only `srun` creates a job step, and with it
SLURM_STEP_ID (SLURM_STEPID in older releases) and SLURM_STEP_NUM_TASKS, so a step is what tells the
two apart. Such a process trains alone, with a note naming `srun python train.py`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from ddpkit.errors import problem

Env = Mapping[str, str]

# The launchers' variables, owned here (doctor shows them, gpucheck starts its checks without them):
RANK_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "MPI_LOCALRANKID",
    "MPI_LOCALNRANKS",
)
LAUNCHER_PREFIXES = ("SLURM_", "TORCHELASTIC_", "PMI_", "OMPI_")  # Slurm, torchrun's agent, MPI


def launcher_vars(env: Env) -> dict[str, str]:
    """The launchers' variables in `env` (what the detectors read, and their families)."""
    return {k: v for k, v in sorted(env.items()) if k in RANK_VARS or k.startswith(LAUNCHER_PREFIXES)}


@dataclass(frozen=True)
class RankEnv:
    """Who this process is, as a launcher described it; `note` is a warning to print once at start."""

    launcher: str  # "torchrun", "pytorchjob", "env", "mpi", "slurm", "slurm-batch" or "none"
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    note: str = ""


def env_int(env: Env, name: str, default: int | None = None) -> int:
    """`env[name]` as an integer; `default` when unset, a clear error when neither."""
    value = env.get(name)
    if value is None or value == "":
        if default is None:
            raise problem(f"{name} is not set", "Launch with `ddpkit run` or torchrun, which set it")
        return default
    try:
        return int(value)
    except ValueError:
        raise problem(
            f"{name}={value!r} is not an integer",
            f"Unset {name} or set it to an integer",
            source="environment",
        ) from None


def _master(env: Env, default_port: int = 29500) -> dict:
    return {
        "master_addr": env.get("MASTER_ADDR") or "127.0.0.1",
        "master_port": env_int(env, "MASTER_PORT", default_port),
    }


# -- one function per launcher ---------------------------------------------------------------------
def torchrun(env: Env) -> RankEnv | None:
    """torchrun, `ddpkit run`, `ddpkit.spawn`: the full elastic contract, LOCAL_RANK included."""
    if not {"RANK", "WORLD_SIZE", "LOCAL_RANK"} <= env.keys():
        return None
    world, rank = env_int(env, "WORLD_SIZE"), env_int(env, "RANK")
    local_world = env_int(env, "LOCAL_WORLD_SIZE", world)
    return RankEnv(
        launcher="torchrun",
        rank=rank,
        world_size=world,
        local_rank=env_int(env, "LOCAL_RANK"),
        local_world_size=local_world,
        node_rank=env_int(env, "GROUP_RANK", rank // max(local_world, 1)),
        **_master(env),
    )


def pytorchjob(env: Env) -> RankEnv | None:
    """Kubeflow's PyTorchJob: the operator sets RANK, WORLD_SIZE and MASTER_* in each pod, no LOCAL_*.

    One process per pod, so every process is local rank 0 of a local world of 1 and its pod is node
    RANK (a pod that runs torchrun inside gets torchrun's LOCAL_* and is detected as torchrun first).
    """
    needed = {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "KUBERNETES_SERVICE_HOST"}
    if not needed <= env.keys() or "LOCAL_RANK" in env:
        return None
    rank = env_int(env, "RANK")
    return RankEnv(
        launcher="pytorchjob",
        rank=rank,
        world_size=env_int(env, "WORLD_SIZE"),
        node_rank=rank,
        **_master(env),
    )


def env_vars(env: Env) -> RankEnv | None:
    """RANK and WORLD_SIZE set by hand (torch's env:// contract) without LOCAL_RANK.

    With LOCAL_WORLD_SIZE, the local rank is RANK % LOCAL_WORLD_SIZE (ranks numbered node by node, as
    every launcher does). Without it, all ranks are taken to share this machine (a shell loop starting
    N processes): local rank = RANK. Several machines without torchrun must set LOCAL_RANK and
    LOCAL_WORLD_SIZE (or run under a launcher detected above).
    """
    if not {"RANK", "WORLD_SIZE"} <= env.keys() or "LOCAL_RANK" in env:
        return None
    world, rank = env_int(env, "WORLD_SIZE"), env_int(env, "RANK")
    local_world = max(env_int(env, "LOCAL_WORLD_SIZE", world), 1)
    return RankEnv(
        launcher="env",
        rank=rank,
        world_size=world,
        local_rank=rank % local_world,
        local_world_size=local_world,
        node_rank=rank // local_world,
        **_master(env),
    )


def mpi(env: Env) -> RankEnv | None:
    """mpirun/mpiexec: Open MPI's OMPI_COMM_WORLD_*, or the PMI_* of MPICH and Intel MPI (hydra).

    Tried before Slurm: mpirun inside an sbatch script starts its ranks through one srun per node,
    so their SLURM_PROCID numbers nodes, not ranks. The group meets at MASTER_ADDR:MASTER_PORT, which
    mpirun does not set: across machines pass `mpirun -x MASTER_ADDR=<first host> ...`.
    """
    if "OMPI_COMM_WORLD_RANK" in env:
        rank, world = env_int(env, "OMPI_COMM_WORLD_RANK"), env_int(env, "OMPI_COMM_WORLD_SIZE")
        local_rank = env_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", rank)
        local_world = env_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", world)
    elif "PMI_RANK" in env and "PMI_SIZE" in env:
        rank, world = env_int(env, "PMI_RANK"), env_int(env, "PMI_SIZE")
        srun_direct = "SLURM_LOCALID" in env and env.get("SLURM_PROCID") == str(rank)
        if "MPI_LOCALRANKID" not in env and srun_direct:
            return None  # `srun --mpi=pmi2`: a Slurm step with PMI on top; Slurm knows the local ranks
        local_rank = env_int(env, "MPI_LOCALRANKID", rank)
        local_world = env_int(env, "MPI_LOCALNRANKS", world)
    else:
        return None
    if local_world < world and not env.get("MASTER_ADDR"):
        raise problem(
            f"mpirun started {world} ranks over several machines ({local_world} on this one) but "
            "MASTER_ADDR is not set, so the ranks cannot find each other",
            "Pass the first host to every rank: mpirun -x MASTER_ADDR=<first host> -x MASTER_PORT=29500 ...",
            source="mpi",
        )
    node = rank // max(local_world, 1)
    return RankEnv(
        launcher="mpi",
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        local_world_size=local_world,
        node_rank=node,
        **_master(env),
    )


def _interactive(env: Env) -> bool:
    """A job named bash/interactive: Lightning's convention for "I start my processes myself"."""
    return env.get("SLURM_JOB_NAME") in ("bash", "interactive")


def _in_step(env: Env) -> bool:
    return "SLURM_STEP_ID" in env or "SLURM_STEPID" in env


NODELISTS = ("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")


def slurm(env: Env) -> RankEnv | None:
    """A task of an `srun` job step: SLURM_PROCID among SLURM_STEP_NUM_TASKS (or SLURM_NTASKS)."""
    if "SLURM_PROCID" not in env or not _in_step(env) or _interactive(env):
        return None
    world = env_int(env, "SLURM_STEP_NUM_TASKS", env_int(env, "SLURM_NTASKS", 1))
    node = env_int(env, "SLURM_NODEID", 0)
    nodes = env_int(env, "SLURM_STEP_NUM_NODES", env_int(env, "SLURM_NNODES", 1))
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
    local_world = tasks_on_node(spec, node) or max(1, world // max(nodes, 1))
    nodelist = next((env[k] for k in NODELISTS if env.get(k)), "")
    return RankEnv(
        launcher="slurm",
        rank=env_int(env, "SLURM_PROCID"),
        world_size=world,
        local_rank=env_int(env, "SLURM_LOCALID", 0),
        local_world_size=local_world,
        node_rank=node,
        master_addr=env.get("MASTER_ADDR") or first_slurm_host(nodelist),
        # A port every task of the job derives identically, away from the well-known range.
        master_port=env_int(env, "MASTER_PORT", 15000 + env_int(env, "SLURM_JOB_ID", 0) % 20000),
    )


def slurm_batch(env: Env) -> RankEnv | None:
    """The sbatch script itself (or an salloc shell): N tasks allocated, but no srun step started them."""
    if "SLURM_PROCID" not in env or _in_step(env) or _interactive(env):
        return None
    tasks = env_int(env, "SLURM_NTASKS", 1)
    if tasks <= 1:
        return None
    return RankEnv(
        launcher="slurm-batch",
        note=f"Slurm allocated {tasks} tasks (SLURM_NTASKS={tasks}) but this process was not started by "
        "srun (no SLURM_STEP_ID: it runs in the batch script itself), so it trains alone, in one "
        f"process, instead of waiting for {tasks - 1} rank(s) that would never start. To train on all "
        f"{tasks} tasks, start it with `srun python train.py` in the sbatch script (or `ddpkit run "
        "--nproc N train.py` for N processes on this node).",
    )


def plain(env: Env) -> RankEnv:
    """No launcher: one process (the zero-configuration default)."""
    return RankEnv(launcher="none")


class Detector(Protocol):
    """A launcher's detector: the `RankEnv` this environment describes, or None when it is not its
    launcher. Pass your own to `ddpkit.session(launcher=...)`; it is asked before the built-in ones."""

    def __call__(self, env: Env) -> RankEnv | None: ...


# Priority order, first match wins. Why this order:
DETECTORS: tuple[Detector, ...] = (
    torchrun,  # an agent's LOCAL_RANK is the most specific; torchrun inside srun or a pod wins
    pytorchjob,  # RANK/WORLD_SIZE without LOCAL_* in a Kubernetes pod: one process per pod
    env_vars,  # RANK/WORLD_SIZE without LOCAL_* anywhere else: someone set env:// by hand
    mpi,  # before Slurm: mpirun's ranks inherit the batch script's (or a proxy step's) SLURM_PROCID
    slurm,  # an srun task
    slurm_batch,  # the Slurm trap: allocated tasks, no step; one process, warned
    plain,  # always answers
)


def detect(env: Env, first: Sequence[Detector] = ()) -> RankEnv:
    """The first answer of `first` (a user's own detectors), then of `DETECTORS`, for `env`."""
    for detector in (*first, *DETECTORS):
        ranks = detector(env)
        if ranks is not None:
            return ranks
    raise AssertionError("plain() always answers")  # pragma: no cover


def describe(ranks: RankEnv) -> str:
    """One human line: which launcher, and who this process is."""
    names = {
        "torchrun": "torchrun-style variables (RANK, WORLD_SIZE, LOCAL_RANK)",
        "pytorchjob": "a Kubernetes PyTorchJob pod (RANK, WORLD_SIZE, MASTER_*; one process per pod)",
        "env": "RANK and WORLD_SIZE set by hand (env://)",
        "mpi": "mpirun (OMPI_COMM_WORLD_* or PMI_*)",
        "slurm": "an srun task (SLURM_PROCID in a job step)",
        "slurm-batch": "a Slurm batch script, not started by srun: one process",
        "none": "no launcher variables: one process",
    }
    who = (
        (
            f"; rank {ranks.rank} of {ranks.world_size}, local rank {ranks.local_rank} of "
            f"{ranks.local_world_size}, node {ranks.node_rank}"
        )
        if ranks.world_size > 1
        else ""
    )
    return names.get(ranks.launcher, ranks.launcher) + who


def first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm node list: "node[03-05,9],gpu1" -> "node03"."""
    match = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if not match:
        return "127.0.0.1"
    prefix, _, ranges = match.groups()
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def tasks_on_node(spec: str, node: int) -> int | None:
    """Tasks on node `node` from Slurm's compressed list: "2(x3),1" -> 2, 2, 2, 1. None if unreadable."""
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not match:
            return None
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts[node] if 0 <= node < len(counts) else None
