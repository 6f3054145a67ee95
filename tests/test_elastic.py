"""Elastic membership (`ddpkit run --nnodes MIN:MAX`) on two hosts: two network namespaces joined by a
veth pair, each running its own `ddpkit run` (torchrun's elastic agent), with a shared checkpoint folder.

A host is lost (its whole process tree SIGKILLed) and the job goes on on the other; a host joins and the
job continues on both. Either way the global batch stays 8 and the final weights match an uninterrupted
run: with `--elastic-batch per-rank` the per-rank batch (4) is kept and ddpkit accumulates 2
micro-batches at world size 1 (a loop with `s.accumulate`, a host joining); by default a session without
accumulation= grows the per-rank batch to 8 instead, and back to 4 when a host joins, so a loop that
cannot accumulate survives too (`s.backward; s.step`, and the README's first loop: a host lost, then a
host joining, in one run); "invariant" (reproducible="any-world") ends bitwise equal (a host lost).
Needs root and iproute2 (skipped otherwise, with the reason).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from conftest import communicate, end_launch, marked, popen_marked
from safetensors.torch import load_file

from ddpkit.cluster.warmstart import client as warm_client
from ddpkit.names import WARM_START_ENV

HERE = Path(__file__).parent
SCRIPT = str(HERE / "elastic_train.py")
REFERENCE = str(HERE / "elastic_reference.py")
# The uninterrupted runs this module compares with, one process for all (tests/elastic_reference.py)
REFERENCE_LOOPS = ("invariant", "step", "plain", "accumulate")
PORT = 29400  # each namespace has its own ports: nothing else listens there (the first test's; then +1)
# Two hosts started together meet within 2 s; a lost host's agent is dropped from the rendezvous after 10 s
# without a heartbeat (ddpkit's defaults: 10 s and ~6 s, for real networks; torch's: 30 s and 15 s).
# Not sooner: with 3 missed 1 s heartbeats, on a loaded machine (the
# suite on two workers beside a 4-rank test) a live host's agent once missed 3 s of them while it held at
# step 8: the joining host then found every participant "dead", formed a round of its own and trained at
# world size 1 beside it (two jobs on one checkpoint folder), and the join never came.
RDZV_CONF = "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=10"

pytestmark = [
    pytest.mark.numerics,
    pytest.mark.must_run("elastic"),
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2 (ip netns)"
    ),
]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


def _netns_pids(ns: str) -> list[int]:
    done = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=20)
    return [int(pid) for pid in done.stdout.split()]


class _Hosts:
    """Two network namespaces, 10.77.0.1 and 10.77.0.2, a veth pair between them, and in each a warm-start
    server (ddpkit.cluster.warmstart) for the module's tests.

    The suite's warm server cannot fork a host's processes: a fork keeps its parent's network namespace, so
    it answers "fresh" to a client inside a namespace, and every host's agent and every worker it (re)starts
    would pay ~5 s of CPU for its imports, in a chain at each change of membership (a join: the joining
    agent, then both re-rendezvoused workers), 3-4x slower on a loaded machine. So each namespace has its own
    server, started there once for the module, and each host's `ddpkit run` names it in DDPKIT_WARM_START:
    every worker its agent starts or restarts is forked warm. The agent itself is a new interpreter (its
    import of torch, ~2.5 s, once per host): agents forked from the servers did not meet reliably (a
    host that joined the rendezvous 0.5 s after the other was left out of its first round, which went on
    at world size 1). Processes enter a namespace with `nsenter --net` (the network namespace only): `ip
    netns exec` also gives every command a mount namespace of its own, which the workers, started by the
    agent, would not share with the server. DDPKIT_TEST_WARM=0 (no DDPKIT_WARM_START): no servers, every
    host's process a new interpreter.
    """

    def __init__(self, tmp_root: Path) -> None:
        tag = f"{os.getpid() % 100000}"
        self.names = [f"ddpk{tag}a", f"ddpk{tag}b"]
        self.links = [f"va{tag}", f"vb{tag}"]
        self.servers: list[subprocess.Popen | None] = [None, None]
        self.warm_dirs: list[Path | None] = [None, None]
        self.warm = bool(os.environ.get(WARM_START_ENV)) and shutil.which("nsenter") is not None
        self.ports = itertools.count(PORT)  # a fresh rendezvous port per test: no socket of the last one
        try:
            for ns in self.names:
                _ip("netns", "add", ns)
            _ip("link", "add", self.links[0], "type", "veth", "peer", "name", self.links[1])
            for i, (ns, link) in enumerate(zip(self.names, self.links, strict=True)):
                _ip("link", "set", link, "netns", ns)
                _ip("-n", ns, "addr", "add", f"10.77.0.{i + 1}/24", "dev", link)
                _ip("-n", ns, "link", "set", link, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except subprocess.CalledProcessError as err:
            self.close()
            pytest.skip(f"network namespaces are not available here: {err.stderr.decode().strip()}")
        if self.warm:
            for i in range(len(self.names)):
                self._serve(i, tmp_root)
            self._await_servers()

    def enter(self, i: int) -> list[str]:
        """The command prefix that runs a command in host i's network namespace (`ip netns` keeps it in
        /var/run/netns); without nsenter, `ip netns exec` (then nothing is forked warm: no servers)."""
        if self.warm:
            return ["nsenter", f"--net=/var/run/netns/{self.names[i]}"]
        return ["ip", "netns", "exec", self.names[i]]

    def env(self, i: int) -> dict[str, str]:
        env = {**os.environ, "GLOO_SOCKET_IFNAME": self.links[i], "OMP_NUM_THREADS": "1"}
        env.pop(WARM_START_ENV, None)  # the suite's server: it cannot fork into the namespace
        if self.warm_dirs[i] is not None:
            env[WARM_START_ENV] = str(self.warm_dirs[i])
        return env

    def _serve(self, i: int, tmp_root: Path) -> None:
        directory = Path(tempfile.mkdtemp(prefix="ddpkit-warm-", dir=tmp_root))  # a short socket path
        log = (directory / "server.log").open("w")
        self.warm_dirs[i] = directory
        self.servers[i] = subprocess.Popen(
            [*self.enter(i), sys.executable, "-m", "ddpkit.cluster.warmstart", str(directory)],
            env=self.env(i),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
        log.close()

    def _await_servers(self) -> None:
        """Until each server listens (before it imports: its clients queue meanwhile); `ddpkit run` looks
        for the client once, and starts its workers as new interpreters if there is none."""
        deadline = time.monotonic() + 10
        for directory in self.warm_dirs:
            assert directory is not None
            while warm_client(directory) is None and time.monotonic() < deadline:
                time.sleep(0.01)

    def lose(self, i: int) -> None:
        """The host is gone: every process of the job in its namespace (the agent, and its workers, which
        torchrun starts in sessions of their own) SIGKILLed at once. All but the namespace's warm server:
        it only imported (no socket of the job's, no file, nothing the other host or the checkpoint folder
        sees), and it stands for the fresh interpreters a host's launcher would start; a new host 1 is then
        new processes (its agent, and workers forked from the server), as a new machine's would be. A worker
        the server was forking at that instant goes too: the server kills a forked process whose client
        (here, killed) has gone."""
        server = self.servers[i]
        keep = {server.pid} if server is not None and server.poll() is None else set()
        for pid in _netns_pids(self.names[i]):
            if pid not in keep:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def close(self) -> None:
        for server in self.servers:
            if server is not None and server.poll() is None:
                server.terminate()  # it kills what it forked and is still running
                with contextlib.suppress(subprocess.TimeoutExpired):
                    server.wait(10)
        for ns in self.names:
            for pid in _netns_pids(ns):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)


@pytest.fixture(scope="module")
def namespaces(tmp_path_factory):
    """The module's two hosts (`_Hosts`): namespaces, link and warm servers, set up once for its tests."""
    made = _Hosts(tmp_path_factory.getbasetemp())
    yield made
    made.close()


@pytest.fixture
def hosts(namespaces: _Hosts):
    """`start(i, ckpt, out, ...)`: host i's `ddpkit run` of tests/elastic_train.py, the test's own
    rendezvous port; `start.lose(i)`. Every process a test started ends with it."""
    net, port = namespaces, next(namespaces.ports)
    started: list[subprocess.Popen] = []

    def start(
        i: int, ckpt: Path, out: Path, run_args: tuple = (), args: tuple = (), log: str = ""
    ) -> subprocess.Popen:
        cmd = [
            *net.enter(i),
            sys.executable,
            "-m",
            "ddpkit.cli",
            "run",
            "--nnodes",
            "1:2",
            "--nproc",
            "1",
            "--max-restarts",
            "3",
            "--rdzv-endpoint",
            f"10.77.0.1:{port}",
            "--local-addr",
            f"10.77.0.{i + 1}",
            "--rdzv-conf",
            RDZV_CONF,
            *run_args,
            SCRIPT,
            str(ckpt),
            str(out),
            *args,
        ]
        file = open(out / (log or f"host{i}.log"), "w")  # noqa: SIM115 (closed with the process)
        proc = subprocess.Popen(
            cmd, env=net.env(i), stdout=file, stderr=subprocess.STDOUT, start_new_session=True
        )
        file.close()  # the child holds its own copy
        started.append(proc)
        return proc

    start.lose = net.lose  # type: ignore[attr-defined]
    yield start
    for i in range(len(net.names)):
        net.lose(i)
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=20)


def _steps(out: Path) -> list[tuple[int, int, int, int]]:
    path = out / "steps.txt"
    lines = path.read_text().split("\n") if path.exists() else []
    return [tuple(int(v) for v in line.split()[:4]) for line in lines if line.strip()]  # type: ignore[misc]


def _wait_for(what, timeout: float, procs: list[subprocess.Popen], out: Path) -> None:
    end = time.monotonic() + timeout
    while not what():
        if time.monotonic() > end or any(p.poll() not in (None, 0) for p in procs):
            logs = "\n".join(p.read_text()[-3000:] for p in sorted(out.glob("host*.log")))
            raise AssertionError(f"timed out or a host failed; steps {_steps(out)}\n{logs}")
        time.sleep(0.1)


class _References:
    """The uninterrupted runs: every loop the module compares with (its REFERENCE_LOOPS) in one unlaunched
    process (tests/elastic_reference.py: world size 1, per-rank batch 8), started in the background where the
    elastic run's timing does not matter (not while the hosts meet or a host joins) and awaited before the
    weights are needed."""

    def __init__(self, root: Path, loops: tuple[str, ...]) -> None:
        self.root, self.loops = root, loops
        self.run: tuple[subprocess.Popen, str] | None = None
        self.done: subprocess.CompletedProcess | None = None

    def start(self) -> None:
        if self.run is None:
            self.run = popen_marked(
                [sys.executable, REFERENCE, str(self.root), *self.loops], env={"OMP_NUM_THREADS": "1"}
            )

    def weights(self, loop: str) -> dict[str, torch.Tensor]:
        self.start()
        assert self.run is not None and loop in self.loops, loop
        if self.done is None:  # ~4 s alone here; ended on a timeout (tests/conftest.py)
            self.done = communicate(*self.run, timeout=40)
        assert self.done.returncode == 0, self.done.stderr
        return load_file(self.root / loop / "final.safetensors")

    def close(self) -> None:
        if self.run is not None:
            proc, mark = self.run
            if proc.poll() is None or marked(mark):
                end_launch(proc, mark)
            proc.communicate()


@pytest.fixture(scope="module")
def references(tmp_path_factory, request):
    refs = _References(tmp_path_factory.mktemp("references"), request.module.REFERENCE_LOOPS)
    yield refs
    refs.close()


def _prepare(tmp_path: Path) -> tuple[Path, Path]:
    """The elastic run's output and checkpoint folders."""
    out = tmp_path / "out"
    out.mkdir()
    return out, tmp_path / "ckpt"


def _check_finished(
    out: Path, reference: dict[str, torch.Tensor], *, bitwise: bool = False
) -> list[tuple[int, int, int, int]]:
    steps = _steps(out)
    assert steps[-1][2] == 24, steps  # 96 samples / global batch 8 x 2 epochs, never more
    for world, accumulation, _, per_rank in steps:
        assert per_rank * world * accumulation == 8, steps  # the global batch, whatever the world size
    final = load_file(out / "final.safetensors")
    for name, want in reference.items():
        if bitwise:  # reproducible="any-world": the same additions in the same order at any world size
            assert torch.equal(final[name], want), (name, float((final[name] - want).abs().max()))
            continue
        rel = float((final[name] - want).abs().max() / want.abs().max())
        assert rel < 1e-5, (name, rel)  # measured ~2e-7: summation order only
    return steps


def _at(world: int, step: int):
    """Whether global rank 0 has logged `step` at world size `world` (its hold follows: see --hold)."""
    return lambda out: any(w == world and n == step for w, _, n, _ in _steps(out))


def _lose_host_1(hosts, a: subprocess.Popen, out: Path) -> None:
    """Host 1 lost while both hosts hold after step 8 at world size 2, then host 0 alone (its worker
    restarted, resumed from step 6) training again.

    Only once step 8 is logged: both hosts are then past step 6's save (host 1 waited there for host 0's
    "done") and between saves (the next due is 9), so the loss fails host 0's barrier at once (gloo sees the
    reset connection) and never lands in a save, where host 0 would wait for host 1's part until 60 s of
    silence (`ddpkit.cluster.lifecycle.SILENT_AFTER`; that case is tests/test_stall_report.py's). Killing
    after 4 steps, as this test once did, hit a save now and then: 78 s instead of ~16.
    """
    lost_at = time.monotonic()
    hosts.lose(1)
    _wait_for(lambda: any(s[0] == 1 for s in _steps(out)), 100, [a], out)
    # the gloo error at once; host 1's agent dropped from the rendezvous after 10 missed heartbeats (10 s,
    # RDZV_CONF); the last call (2 s); a worker's start and resume
    print(f"elastic: host lost -> training again at world size 1 after {time.monotonic() - lost_at:.1f} s")


def _check_lost(out: Path) -> None:
    """Host 0's log: the per-rank batch grew, and every resume came from a periodic checkpoint."""
    log = (out / "host0.log").read_text()
    assert "elastic: world size 1 of up to 2: the per-rank batch grows 2x" in log
    resumed = [int(n) for n in re.findall(r"resumed from \S+ \(step (\d+)\)", log)]
    assert resumed and all(n % 3 == 0 for n in resumed), resumed  # from the periodic checkpoints only


# Inner limits in order (issue 28): meeting 45 + back at world 1 100 + the end 45 + reference 40 = 230 s,
# under the test's 280 s, so the inner limit's message and the fixture's clean-up come first.
@pytest.mark.timeout(280)
@pytest.mark.parametrize("loop", ["invariant"])
def test_a_lost_host_and_the_job_finishes_on_the_other(hosts, references, tmp_path: Path, loop: str) -> None:
    # Issue 35: "invariant" (reproducible="any-world") ends bitwise equal to the uninterrupted run, though
    # its steps ran at world size 2, then 1 (a chunk per rank, then two), and some were run twice. It saves
    # with s.save(..., every=3) after every step (audit item 3): the survivor redoes steps 7 and 8.
    # At world size 2 both hosts hold after step 8 (the last periodic checkpoint is step 6) until host 1 is
    # lost and host 0's worker restarted: the loss comes mid-run whatever the load. No pause after it.
    # The loops that cannot accumulate ("step", "plain") lose a host in the test below, then gain one.
    args = ("--loop", loop, "--save-every", "3", "--hold", "2:8", "--sleep", "0")
    out, ckpt = _prepare(tmp_path)
    a, b = hosts(0, ckpt, out, args=args), hosts(1, ckpt, out, args=args)
    _wait_for(lambda: _at(2, 8)(out), 45, [a, b], out)
    references.start()  # only now: a busy CPU could split the hosts' first meeting
    _lose_host_1(hosts, a, out)
    assert a.wait(timeout=45) == 0, (out / "host0.log").read_text()[-3000:]
    steps = _check_finished(out, references.weights(loop), bitwise=loop == "invariant")
    worlds = [w for w, *_ in steps]
    assert worlds[0] == 2 and worlds[-1] == 1, steps
    _check_lost(out)


# meeting 45 + back at world 1 100 + step 12 45 + the join 45 + the end 2 x 30 + reference 40 = 335 s, under 380 s
@pytest.mark.timeout(380)
@pytest.mark.parametrize("loop", ["step", "plain"])
def test_a_lost_host_then_a_joining_host_and_the_job_finishes_on_both(
    hosts, references, tmp_path: Path, loop: str
) -> None:
    # Issue 32: a loop that cannot accumulate (`s.backward; s.step` without a block, or the README's first
    # loop, plain torch) survives: by default (--elastic-batch auto) the per-rank batch grows to 8 at world
    # size 1, said in one line, and is 4 again once a host joins. Each saves periodically (audit item 3),
    # not after every step: "step" with s.save(..., every=3) after every step, "plain" like the README,
    # `if step % 3 == 0: s.save(...)`; each restart resumes from the last periodic checkpoint.
    # One run, both changes: both hosts hold after step 8 at world size 2 until host 1 is lost; host 0 alone
    # resumes from step 6 and holds after step 12 (saved) until a new host 1 has joined; both resume from
    # step 12 and finish at world size 2. (Two runs, a loss and a join, took 25 + 20 s; this one ~35 s.)
    idiom = ("--idiom", "if" if loop == "plain" else "every", "--save-every", "3")
    args = ("--loop", loop, *idiom, "--hold", "2:8", "--hold", "1:12", "--sleep", "0")
    out, ckpt = _prepare(tmp_path)
    a, b = hosts(0, ckpt, out, args=args), hosts(1, ckpt, out, args=args)
    _wait_for(lambda: _at(2, 8)(out), 45, [a, b], out)
    _lose_host_1(hosts, a, out)
    _wait_for(lambda: _at(1, 12)(out), 45, [a], out)
    b, joined = hosts(1, ckpt, out, args=args, log="host1-joining.log"), time.monotonic()
    _wait_for(lambda: _steps(out)[-1][0] == 2, 45, [a, b], out)
    print(f"elastic: host started -> training at world size 2 after {time.monotonic() - joined:.1f} s")
    references.start()  # only now: a busy CPU could split the hosts' meetings
    for i, host in enumerate((a, b)):
        assert host.wait(timeout=30) == 0, (out / f"host{i}.log").read_text()[-3000:]
    steps = _check_finished(out, references.weights(loop))
    worlds = [w for w, *_ in steps]
    changes = [w for i, w in enumerate(worlds) if i == 0 or w != worlds[i - 1]]
    assert changes == [2, 1, 2], steps  # met, lost one, gained one: no other round trained
    assert all(per_rank == 8 // w and acc == 1 for w, acc, _, per_rank in steps), steps  # 4, grown 8, 4 again
    _check_lost(out)


# meeting 45 + the join 45 + the end 2 x 30 + reference 40 = 190 s, under 220 s.
@pytest.mark.timeout(220)
@pytest.mark.parametrize("loop", ["accumulate"])
def test_a_joining_host_and_the_job_continues_on_both(hosts, references, tmp_path: Path, loop: str) -> None:
    # `--elastic-batch per-rank` and a loop in `with s.accumulate(model):`: alone, the per-rank batch (4) is
    # kept and the loop accumulates 2; after the join 1. (The default rule's join, for loops that cannot
    # accumulate, is the test above's second change.)
    out, ckpt = _prepare(tmp_path)
    keep = ("--elastic-batch", "per-rank")
    # Alone, host 0 holds after step 8 until host 1 has joined (its agent restarts the worker): the join
    # happens mid-run however long host 1 takes to start under load (a pause per step did not ensure it:
    # at load ~13 host 0 once finished all 24 steps alone). No pause after the join: nothing changes again.
    alone = ("--loop", loop, "--hold", "1:8", "--sleep", "0")
    a = hosts(0, ckpt, out, run_args=keep, args=alone)
    _wait_for(lambda: _at(1, 8)(out), 45, [a], out)
    b, joined = hosts(1, ckpt, out, run_args=keep, args=alone), time.monotonic()
    _wait_for(lambda: any(s[0] == 2 for s in _steps(out)), 45, [a, b], out)
    print(f"elastic: host started -> training at world size 2 after {time.monotonic() - joined:.1f} s")
    references.start()  # only now: a busy CPU could make host 1 join too late
    assert a.wait(timeout=30) == 0 and b.wait(timeout=30) == 0, (out / "host0.log").read_text()[-3000:]
    steps = _check_finished(out, references.weights(loop))
    worlds = [w for w, *_ in steps]
    assert worlds[0] == 1 and worlds[-1] == 2, steps
    assert any(acc == 2 and per_rank == 4 for w, acc, _, per_rank in steps if w == 1), steps
