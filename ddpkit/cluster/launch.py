"""`ddpkit run`: torchrun's elastic agent (torch.distributed.run), with ddpkit's defaults.

    ddpkit run train.py                         # --nproc auto: one per GPU, or 1 on a CPU-only machine
    ddpkit run --nproc 2 train.py --lr 0.1      # two CPU ranks with gloo, a free port picked by the OS
    ddpkit run --nnodes 2 --node-rank 0 --nproc 4 --rdzv-endpoint host0:29400 train.py   # on host0
    ddpkit run --nnodes 2 --node-rank 1 --nproc 4 --rdzv-endpoint host0:29400 train.py   # on host1
    ddpkit run --max-restarts 3 train.py        # the agent restarts all workers after a failure
    ddpkit run --nproc 2 --share-gpu train.py   # 2 ranks on one GPU over gloo: correctness, not speed
    ddpkit run --preemption-signal USR2 --grace 120 train.py   # submitit's signal; 120 s to save

What ddpkit adds to torchrun: the process count from the hardware, a rendezvous port the OS picks
(single node), a clear error for a busy explicit port or a missing script, CPU threads per rank =
cores // nproc (and one warning when CPU ranks x threads exceed the cores), and the failing rank's
exit code returned as the command's own. This module imports only the standard library until
`launch()` hands over to torch.distributed.run, so `ddpkit run` starts as fast as `torchrun`.

Warm start: with DDPKIT_WARM_START naming a running `ddpkit.cluster.warmstart` server, each rank is
forked from that server (torch and ddpkit already imported) instead of a new interpreter: for a
developer's loop of short runs and the test suite; the ranks run the same script with the same
environment (that module's docstring says what they share with the server).

Restarts: after a failure the agent stops every worker and starts them all again (at most
--max-restarts times); a script that calls `s.load(root, ...)` at start resumes from its newest valid
checkpoint, so a killed worker costs only the steps since that checkpoint. When the budget is used
up, one report names the rank that failed first, its exit code and message. Ctrl-C (SIGINT) or
SIGTERM stops every worker (the agent signals them, then kills what is left after --grace seconds,
30 by default) and returns 128 + the signal number; 0 when every rank had finished and exited 0 (a
signal too late to be agreed on: the work was done, nothing is to be resumed).

Memory snapshots (`ddpkit.cluster.keeper`, `ddpkit.checkpoint.memory`): on each host a keeper process,
started here and ended with this command however it ends, holds the snapshots a script asks for with
`s.load(root, ..., memory=N)` (the whole state every N optimizer steps, in shared memory that outlives a
killed rank); after a restart the ranks resume from the newest step all of them hold, so a killed rank
costs the step in flight, not the steps since the last checkpoint. It costs a script that does not ask
nothing but the keeper's start (a small standard-library process). Across hosts (--nnodes N or MIN:MAX)
each keeper also listens on a TCP port the OS picks, with a job token made here (in the ranks' and the
keeper's environment, never on a command line); the ranks meet through the job's store and wire each
host's keeper to the next host's, which holds a copy of its snapshots: a lost host's replacement takes
its ranks' state from there.

Preemption (`ddpkit.cluster.preemption`): SIGTERM or the preemption signal (--preemption-signal, USR1 by
default) reaching this process is passed on to every worker (torchrun's --signals-to-handle), which
agree on one step (at `s.step`, `s.save` or the loader's next batch), save the state last given to
`s.load`/`s.save` there and exit 75; this command then prints "preempted at step N, checkpoint ..."
and returns 75 ("resume me"), not an error. --grace bounds how long the agent waits
for that save (torchrun's --shutdown-timeout); --requeue (auto, 1, 0) is passed to the ranks, where
global rank 0 runs `scontrol requeue $SLURM_JOB_ID` after the save.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpkit.cluster import rank_output
from ddpkit.cluster.keeper import ADDRESS_ENV, TOKEN_ENV, Keeper
from ddpkit.cluster.run_report import report, restart_reports
from ddpkit.cluster.signals import PreemptionOptions, signal_of
from ddpkit.cluster.topology import Hardware, threads_per_process
from ddpkit.cluster.warmstart import client as warm_client
from ddpkit.errors import DdpkitError, problem
from ddpkit.names import (
    DEFAULT_PREEMPTION_SIGNAL,
    DEVICE_ENV,
    ELASTIC_BATCH_CHOICES,
    ELASTIC_BATCH_ENV,
    ELASTIC_WORLD_ENV,
    KEEPER_ENV,
    PREEMPTED_EXIT_CODE,
    PREEMPTION_RECORD_ENV,
    RUN_ENV,
    SHARE_GPU_ENV,
    SIGNALLED_FILE,
    WARM_START_ENV,
)
from ddpkit.parallel import cpu_allocator


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """What to start and how; validated on construction."""

    target: str  # a script path, or a module name when `module` is True
    args: tuple[str, ...] = ()
    module: bool = False
    nproc: int | str = "auto"
    device: str = "auto"
    share_gpu: bool = False  # more local ranks than GPUs, round-robin over gloo (ddpkit.cluster.topology)
    nnodes: int = 1  # the most nodes; with `min_nodes`, an elastic job of min_nodes..nnodes
    min_nodes: int | None = None  # --nnodes MIN:MAX: nodes may leave or join (torchrun's elastic agent)
    elastic_batch: str = "auto"  # at fewer ranks keep "per-rank" (accumulate more) or "accumulation"
    rdzv_conf: str | None = None  # torchrun's --rdzv-conf, over ddpkit's elastic timeouts
    local_addr: str | None = None  # this node's address for the others (torchrun's --local-addr)
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    port: int | None = None
    max_restarts: int = 0
    monitor_interval: float = 0.1
    preemption_signal: str = DEFAULT_PREEMPTION_SIGNAL  # besides SIGTERM: asks for a save-and-stop
    requeue: str = "auto"  # under Slurm: "auto" (if submitted with --requeue), "1" or "0"
    grace: float = 30.0  # seconds the agent waits for workers to stop (save) before SIGKILL
    extra_env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.nproc != "auto" and (not isinstance(self.nproc, int) or self.nproc < 1):
            raise problem(
                f"--nproc {self.nproc} is not a process count",
                "Pass --nproc auto (one per GPU, or 1 on CPU) or a whole number of at least 1",
            )
        if self.nnodes < 1:
            raise problem(f"--nnodes {self.nnodes} is below 1", "Pass --nnodes 1 or more")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise problem(
                f"--nnodes {self.nnodes} needs a meeting point for the nodes",
                "Pass --rdzv-endpoint HOST:PORT with the same value on every node",
            )
        if self.min_nodes is not None:
            self._check_elastic()
        if self.node_rank is not None and not 0 <= self.node_rank < self.nnodes:
            raise problem(
                f"--node-rank {self.node_rank} is outside 0..{self.nnodes - 1}",
                "Give each node a distinct rank from 0 to --nnodes - 1",
            )
        if self.max_restarts < 0:
            raise problem(f"--max-restarts {self.max_restarts} is negative", "Pass 0 or more")
        PreemptionOptions(signal=self.preemption_signal, requeue=self.requeue)  # checked by `cluster.signals`
        if not self.grace > 0:
            raise problem(
                f"--grace {self.grace} is not a positive number of seconds", "Pass e.g. --grace 120"
            )
        if self.module:
            if importlib.util.find_spec(self.target.split(".")[0]) is None:
                raise problem(f"module {self.target!r} cannot be found", "Check the name and your PYTHONPATH")
        elif not os.path.isfile(self.target):
            raise problem(
                f"script {self.target!r} does not exist",
                "Check the path (relative to the current directory), or use -m for a module",
            )

    @property
    def stop_policy(self) -> PreemptionOptions:
        """--preemption-signal and --requeue, as the ranks will read them (`ddpkit.cluster.signals`)."""
        return PreemptionOptions(signal=self.preemption_signal, requeue=self.requeue)

    def _check_elastic(self) -> None:
        span = f"--nnodes {self.min_nodes}:{self.nnodes}"
        if not 1 <= self.min_nodes <= self.nnodes:  # type: ignore[operator]
            raise problem(f"{span} is not MIN:MAX with 1 <= MIN <= MAX", "Pass e.g. --nnodes 1:4")
        if self.node_rank is not None:
            raise problem(
                f"{span} with --node-rank {self.node_rank}: elastic nodes get their ranks when they meet",
                "Leave --node-rank out (or pass a fixed --nnodes N)",
            )
        if self.max_restarts < 1:
            raise problem(
                f"{span} restarts the workers when a node is lost, but --max-restarts is {self.max_restarts}",
                "Give it a budget, e.g. --max-restarts 3 (a node joining does not use it)",
            )
        if self.elastic_batch not in ELASTIC_BATCH_CHOICES:
            raise problem(
                f"--elastic-batch {self.elastic_batch} is not auto, per-rank or accumulation",
                "Pass auto (the default: per-rank if the session accumulates), per-rank (more "
                "accumulation at fewer ranks) or accumulation (a larger per-rank batch)",
            )


ELASTIC_RDZV_CONF = (  # see docs/fault-tolerance.md, "Elastic membership"
    "join_timeout=600,last_call_timeout=10,close_timeout=10,keep_alive_interval=2,keep_alive_max_attempt=3"
)


def resolve_nproc(nproc: int | str, hardware: Hardware, device: str = "auto") -> int:
    """`auto` is one process per GPU, or one process on a CPU-only machine (it uses every core)."""
    if nproc != "auto":
        return int(nproc)
    return hardware.gpus if hardware.gpus > 0 and device != "cpu" else 1


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit():
        raise problem(
            f"rendezvous endpoint {endpoint!r} is not HOST:PORT", "Pass e.g. --rdzv-endpoint 10.0.0.1:29400"
        )
    return host, int(port)


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _is_local(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "0.0.0.0", socket.gethostname())


def torchrun_argv(cfg: LaunchConfig, nproc: int) -> list[str]:
    """The torchrun command line that implements `cfg` (also handy to print for users)."""
    argv = [f"--nproc-per-node={nproc}", f"--max-restarts={cfg.max_restarts}"]
    argv.append(f"--monitor-interval={cfg.monitor_interval}")
    preempt = signal_of(cfg.preemption_signal).name
    handled = dict.fromkeys(["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", preempt])  # the agent passes them on
    argv += [f"--signals-to-handle={','.join(handled)}", f"--shutdown-timeout={int(cfg.grace)}"]
    if cfg.nnodes == 1 and cfg.rdzv_endpoint is None:
        if cfg.port is None:
            argv.append("--standalone")  # c10d rendezvous on localhost:0, the OS picks the port
        else:
            if not port_is_free(cfg.port):
                raise _busy(cfg.port)
            argv += ["--master-addr=127.0.0.1", f"--master-port={cfg.port}"]  # MASTER_PORT is this port
    else:
        host, port = split_endpoint(cfg.rdzv_endpoint or f"127.0.0.1:{cfg.port}")
        elastic = cfg.min_nodes is not None
        argv.append(f"--nnodes={cfg.min_nodes}:{cfg.nnodes}" if elastic else f"--nnodes={cfg.nnodes}")
        # With --local-addr, the node whose address is the endpoint's hosts the rendezvous store (torch's
        # guess compares host names, which nodes in containers or namespaces can share: then none hosts it)
        hosting = f"is_host={int(cfg.local_addr == host)}" if cfg.local_addr else None
        if elastic:
            conf = ",".join(filter(None, [ELASTIC_RDZV_CONF, hosting, cfg.rdzv_conf]))  # the user's last: win
            argv += [
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint={host}:{port}",
                "--rdzv-id=ddpkit",
                f"--rdzv-conf={conf}",
            ]
        elif cfg.node_rank is not None:
            # Static rendezvous: node ranks are the user's, node 0 hosts the store at host:port.
            if cfg.node_rank == 0 and _is_local(host) and not port_is_free(port):
                raise _busy(port)
            argv += [f"--node-rank={cfg.node_rank}", f"--master-addr={host}", f"--master-port={port}"]
        else:  # a fixed number of nodes meeting through the c10d store, as above
            conf = ",".join(filter(None, [hosting, cfg.rdzv_conf]))
            argv += [
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint={host}:{port}",
                "--rdzv-id=ddpkit",
                *([f"--rdzv-conf={conf}"] if conf else []),
            ]
    if cfg.local_addr:
        argv.append(f"--local-addr={cfg.local_addr}")
    if cfg.module:
        argv.append("-m")
    return [*argv, cfg.target, *cfg.args]


def oversubscription(nproc: int, threads: str, cores: int) -> str | None:
    """A warning when CPU ranks x threads exceed this node's cores, or None when they fit."""
    per_rank = int(threads) if threads.isdigit() and int(threads) > 0 else 1
    if nproc * per_rank <= cores:
        return None
    return (
        f"ddpkit run: warning: {nproc} processes x {per_rank} thread(s) on {cores} CPU core(s): the ranks "
        "take turns on the cores and every all-reduce waits for the one descheduled last (measured on 2 "
        "cores: 2 x 2 threads 1.75-2.7x slower per step than 2 x 1). "
        f"Use --nproc {max(1, cores // per_rank)} or fewer, or OMP_NUM_THREADS so that processes x "
        "threads <= cores."
    )


def _busy(port: int) -> DdpkitError:
    return problem(
        f"port {port} is already in use on this machine",
        "Pick another port, or leave --port out and ddpkit lets the OS choose a free one",
    )


def launch(cfg: LaunchConfig, hardware: Hardware | None = None) -> int:
    """Start the job through torchrun's agent and wait; return its exit code (0 on success)."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    hardware = hardware or Hardware.detect()
    nproc = resolve_nproc(cfg.nproc, hardware, cfg.device)
    argv = torchrun_argv(cfg, nproc)
    os.environ.update(cfg.extra_env)
    if cfg.device != "auto":
        os.environ[DEVICE_ENV] = cfg.device
    if cfg.share_gpu:
        os.environ[SHARE_GPU_ENV] = "1"
    if cfg.min_nodes is not None:  # read by ddpkit.data.elastic_accumulation in every rank
        os.environ.update({ELASTIC_WORLD_ENV: str(cfg.nnodes * nproc), ELASTIC_BATCH_ENV: cfg.elastic_batch})
    if cfg.min_nodes is not None or (cfg.nnodes > 1 and cfg.node_rank is None):
        # Nodes meeting through the c10d rendezvous get a store of their own in every round (hosted by the
        # round's rank 0, which publishes its address in that round), not torch's store shared across
        # rounds: there a node joining a later round waits for a MASTER_ADDR nobody writes again (seen: a
        # 60 s store timeout on both nodes), and the agents' restart counts, which name each attempt's
        # keys, differ between nodes (an agent that restarts its healthy ranks for another node's failure
        # counts no restart), so the ranks of one round read the dead round's addresses.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    record = Path(tempfile.mkdtemp(prefix="ddpkit-run-")) / "preempted.json"
    os.environ.update({**cfg.stop_policy.env(), PREEMPTION_RECORD_ENV: str(record), RUN_ENV: "1"})
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_process(hardware.cpu_cores, nproc)))
    if cfg.device == "cpu" or hardware.gpus == 0:
        os.environ.update(cpu_allocator.rank_env())  # read by torch as each rank starts
        note = oversubscription(nproc, os.environ["OMP_NUM_THREADS"], hardware.cpu_cores)
        if note:
            print(note, file=sys.stderr, flush=True)
    warm = warm_client(os.environ[WARM_START_ENV]) if os.environ.get(WARM_START_ENV) else None
    if warm is not None and "PYTHON_EXEC" not in os.environ:  # torchrun's variable for the interpreter
        os.environ["PYTHON_EXEC"] = str(warm)  # the forked rank makes its own output line-buffered
    else:  # each new interpreter's output line-buffered (rank_output): ranks' lines never tear
        site = str(rank_output.write_site(record.parent))
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [site, os.environ.get("PYTHONPATH")]))
    keeper = start_keeper(cfg) if hasattr(os, "memfd_create") else None  # the main thread: its lifetime
    try:
        with restart_reports(cfg.max_restarts), marking_signals(record.with_name(SIGNALLED_FILE)) as ends:
            run(parse_args(argv))
    except ChildFailedError as err:
        return _preempted(record) or report(err, cfg.max_restarts)
    except SignalException as err:
        sig = signal.Signals(err.sigval)
        if keeper is not None:
            keeper.stop()  # not a worker: `_drain` waits for every child of this process
        _drain(cfg.grace)  # a second signal cuts the agent's own wait short: the ranks may still be saving
        if code := _preempted(record):
            return code
        if ends.codes and all(code == 0 for code in ends.codes):  # the work was done: nothing to resume
            print(
                f"ddpkit run: {sig.name} arrived as the run was ending: every rank finished and exited 0 "
                "before the ranks agreed to stop, so nothing was cut short and no preemption checkpoint "
                "was needed.",
                file=sys.stderr,
                flush=True,
            )
            return 0
        print(
            f"ddpkit run: stopped by {sig.name}; every rank was signalled and has exited.",
            file=sys.stderr,
            flush=True,
        )
        return 128 + int(sig)
    finally:
        if keeper is not None:
            keeper.stop()  # the snapshots' memory is freed with it
        shutil.rmtree(record.parent / "site", ignore_errors=True)
        with contextlib.suppress(OSError):
            record.unlink(missing_ok=True)
            record.parent.rmdir()
    return 0


def start_keeper(cfg: LaunchConfig) -> Keeper:
    """This host's snapshot keeper, named to the ranks by environment (with its TCP address and job
    token across hosts, where the ranks wire it to the next host's: `ddpkit.checkpoint.memory_hosts`)."""
    across = cfg.nnodes > 1 or cfg.min_nodes is not None
    keeper = Keeper.start(tcp="0.0.0.0:0" if across else None)  # port 0: the OS picks
    os.environ.update({KEEPER_ENV: keeper.name, TOKEN_ENV: keeper.token})
    os.environ.pop(ADDRESS_ENV, None)  # one host: nothing to meet (and no address of an earlier launch)
    if keeper.tcp is not None:
        os.environ[ADDRESS_ENV] = f"{_reachable_address(cfg)}:{keeper.tcp.rpartition(':')[2]}"
    return keeper


def _reachable_address(cfg: LaunchConfig) -> str:
    """This host's address as the other hosts reach it: --local-addr, else the one this host would send
    from towards the rendezvous endpoint (no packet is sent), else its name."""
    if cfg.local_addr:
        return cfg.local_addr
    host = (cfg.rdzv_endpoint or "").rpartition(":")[0] or "127.0.0.1"
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return str(probe.getsockname()[0])
    return socket.getfqdn()


@dataclass
class WorkerEnds:
    """How this node's workers ended when the agent stopped them for a signal: their exit codes (None
    when unknown). All 0: a signal that reached the ranks too late to be agreed on (the run finished
    first) ends the launch with 0, not 128 + n: a scheduler must not take finished work for lost."""

    codes: list[int] | None = None


@contextlib.contextmanager
def marking_signals(marker: Path) -> Iterator[WorkerEnds]:
    """While torchrun's agent runs here: `marker` exists once it passes a signal on to the workers.

    The agent stops its workers with SIGTERM both when this process was signalled (a preemption: the
    ranks should save) and when a peer failed (the survivors should end at once, as they always did,
    not wait 30 s for SIGKILL). Only the first calls `LocalElasticAgent._shutdown` with the signal, so
    this wraps it (a private seam of torch, for the duration of the run, put back after) and creates
    `marker` first; `ddpkit.cluster.preemption` reads it before it takes a SIGTERM for a preemption.
    Once the agent has stopped the workers, the exit codes it waited for go into the `WorkerEnds` this
    yields (read from the agent's process context; another torch leaves them unknown)."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    ends = WorkerEnds()
    original = getattr(LocalElasticAgent, "_shutdown", None)
    if original is None:  # another torch: every SIGTERM counts as a preemption (the ranks save, then end)
        with contextlib.suppress(OSError):
            marker.touch()
        yield ends
        return

    def shutdown(agent: Any, *args: Any, **kwargs: Any) -> Any:
        signalled = bool(args) or "death_sig" in kwargs  # the signal path; a failure or the end pass none
        if signalled:
            with contextlib.suppress(OSError):
                marker.touch()
        result = original(agent, *args, **kwargs)
        if signalled:
            handlers = getattr(getattr(agent, "_pcontext", None), "subprocess_handlers", None)
            codes = [getattr(getattr(h, "proc", None), "returncode", None) for h in (handlers or {}).values()]
            ends.codes = [c for c in codes if isinstance(c, int)] if codes and None not in codes else None
        return result

    LocalElasticAgent._shutdown = shutdown  # type: ignore[method-assign,assignment]
    try:
        yield ends
    finally:
        LocalElasticAgent._shutdown = original  # type: ignore[method-assign]


def _children() -> list[int]:
    pids: list[int] = []
    for task in Path("/proc/self/task").glob("*/children"):
        with contextlib.suppress(OSError, ValueError):
            pids += [int(p) for p in task.read_text().split()]
    return pids


def _drain(grace: float) -> None:
    """Wait up to `grace` seconds for the workers to exit, passing on further signals, then kill them.

    torchrun's agent waits for its workers after the first signal, but a second one (a user's second
    Ctrl-C, a second SIGTERM from the scheduler) raises out of that wait and would leave ranks that
    are writing a checkpoint behind this process. Linux only (/proc); elsewhere nothing to wait for.
    """
    import time

    def forward(signum: int, frame: object) -> None:
        for pid in _children():
            with contextlib.suppress(OSError):
                os.kill(pid, signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    end = time.monotonic() + grace
    while (pids := _children()) and time.monotonic() < end:
        for pid in pids:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
        time.sleep(0.05)
    for pid in _children():
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def _preempted(record: Path) -> int:
    """`PREEMPTED_EXIT_CODE` (75) and one line when global rank 0 saved a preemption checkpoint; else 0."""
    try:
        done = json.loads(record.read_text())
    except (OSError, ValueError):
        return 0
    requeued = " The Slurm job was requeued." if done.get("requeued") else ""
    print(
        f"ddpkit run: preempted ({done.get('signal')}) at step {done.get('step')}, checkpoint "
        f"{done.get('checkpoint')}; run the same command to resume (exit code {PREEMPTED_EXIT_CODE})."
        f"{requeued}",
        file=sys.stderr,
        flush=True,
    )
    return PREEMPTED_EXIT_CODE
