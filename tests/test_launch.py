"""`ddpkit run` and `ddpkit.spawn` as a user drives them: real processes, real torchrun agent."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import textwrap
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from conftest import REPO, communicate, end_launch, marked, popen_cli, run_cli

import ddpkit

PLAIN_TORCHRUN_SCRIPT = """
import json, os, sys
import torch, torch.distributed as dist
from torch.utils.data import DistributedSampler

dist.init_process_group("gloo")                      # env:// as torchrun documents it
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
sampler = DistributedSampler(range(20), num_replicas=world, rank=rank, shuffle=True, seed=0)
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
out = {"rank": rank, "world": world, "local_rank": int(os.environ["LOCAL_RANK"]), "sum": t.item(),
       "threads": torch.get_num_threads(), "indices": list(sampler), "args": sys.argv[1:],
       "master": [os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]]}
with open(os.path.join(os.environ["OUT_DIR"], f"rank{rank}.json"), "w") as f:
    json.dump(out, f)
dist.destroy_process_group()
"""


def _script(tmp_path: Path, body: str, name: str = "train.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def _ranks(tmp_path: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]


def test_plain_torchrun_script_runs_unchanged(tmp_path: Path) -> None:
    script = _script(tmp_path, PLAIN_TORCHRUN_SCRIPT)
    done = run_cli("run", "--nproc", "2", str(script), "--lr", "0.1", env={"OUT_DIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    ranks = _ranks(tmp_path)
    assert [r["rank"] for r in ranks] == [0, 1] and {r["world"] for r in ranks} == {2}
    assert {r["sum"] for r in ranks} == {3.0}
    assert {r["threads"] for r in ranks} == {1}, "2 cores / 2 processes = 1 thread each"
    assert set(ranks[0]["indices"]).isdisjoint(ranks[1]["indices"])
    assert ranks[0]["args"] == ["--lr", "0.1"]
    assert ranks[0]["master"][0] in ("localhost", "127.0.0.1") and int(ranks[0]["master"][1]) > 0


def test_module_target_and_exit_code_come_back(tmp_path: Path) -> None:
    # The module is found in the working directory, as `python -m` finds it (a PYTHONPATH of its own
    # would make the launcher and its ranks new interpreters instead of the suite's warm ones)
    (tmp_path / "exiting.py").write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    done = run_cli("run", "--nproc", "2", "-m", "exiting", cwd=tmp_path)
    assert done.returncode == 3
    assert "rank 1" in done.stderr and "exit code 3" in done.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_on_one_machine_form_one_job(tmp_path: Path) -> None:
    script = _script(tmp_path, PLAIN_TORCHRUN_SCRIPT)
    port = _free_port()
    cmd = ["run", "--nnodes", "2", "--nproc", "2", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    nodes = [
        popen_cli(*cmd, "--node-rank", str(r), str(script), env={"OUT_DIR": str(tmp_path)}) for r in (0, 1)
    ]
    try:  # 50 s each, one after the other: under pytest's 120 s
        done = [communicate(proc, mark, timeout=50) for proc, mark in nodes]
    finally:
        for proc, mark in nodes:
            end_launch(proc, mark)
    outputs = [(d.stdout, d.stderr) for d in done]
    assert [d.returncode for d in done] == [0, 0], outputs
    ranks = _ranks(tmp_path)
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert {r["world"] for r in ranks} == {4} and {r["sum"] for r in ranks} == {10.0}
    assert [r["local_rank"] for r in ranks] == [0, 1, 0, 1]


TWO_NODE_RESTART_SCRIPT = """
import os, sys, time
from pathlib import Path
import torch, torch.distributed as dist
import ddpkit

out = Path(sys.argv[1])
with ddpkit.session(seed=0, rendezvous_timeout=60, verbose=False) as s:
    rank = dist.get_rank()
    with open(out / f"life-rank{rank}-count{os.environ['TORCHELASTIC_RESTART_COUNT']}", "a") as f:
        f.write("x")  # one x per start
    for step in range(5):
        if step == 3 and not (out / "died").exists():
            if rank == 1:  # a long step on node 1, outside any collective: its agent finds it healthy
                (out / "busy").touch()
                time.sleep(60)  # ended by its agent's restart for the other node
            while not (out / "busy").exists():
                time.sleep(0.05)
            (out / "died").touch()
            os._exit(1)  # rank 0, on node 0, fails while rank 1 is busy
        t = torch.ones(1)
        dist.all_reduce(t)
    (out / f"sum-rank{rank}").write_text(str(t.item()))
"""


def test_a_rank_failing_on_one_node_restarts_both_nodes_into_one_group(tmp_path: Path) -> None:
    # Two agents meeting through the c10d rendezvous (`--nnodes 2`, no node ranks). Node 0's rank fails and
    # its agent counts a restart; node 1's healthy rank is restarted for the new round and its agent counts
    # none, so the two nodes' restart counts differ. ddpkit run gives every round a store of its own: the
    # ranks meet again without node 1 failing once more on the dead round's addresses (a wasted restart).
    script = _script(tmp_path, TWO_NODE_RESTART_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    port = _free_port()
    cmd = [
        "run",
        "--nnodes",
        "2",
        "--nproc",
        "1",
        "--max-restarts",
        "2",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
    ]
    nodes = [popen_cli(*cmd, str(script), str(out)) for _ in range(2)]
    try:  # 50 s each, one after the other: under pytest's 120 s
        done = [communicate(proc, mark, timeout=50) for proc, mark in nodes]
    finally:
        for proc, mark in nodes:
            end_launch(proc, mark)
    logs = "\n".join(f"--- node {n} (exit {d.returncode}):\n{d.stderr[-2500:]}" for n, d in enumerate(done))
    assert [d.returncode for d in done] == [0, 0], logs
    lives = {p.name: len(p.read_text()) for p in out.glob("life-*")}
    # the case in question: rank 0 came back at restart count 1, rank 1 twice at 0 (restarted, not failed)
    assert lives == {"life-rank0-count0": 1, "life-rank0-count1": 1, "life-rank1-count0": 2}, (lives, logs)
    assert [(out / f"sum-rank{r}").read_text() for r in (0, 1)] == ["2.0", "2.0"]
    restarts = [re.findall(r"ddpkit run: restart \d+ of 2: (rank \d+)", d.stderr) for d in done]
    assert sorted(restarts) == [[], ["rank 0"]], (restarts, logs)  # one restart in all: rank 0's
    assert "Connection refused" not in logs


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "--nproc", "0", "x.py"], r"--nproc 0 is not a process count"),
        (["run", "--nproc", "two", "x.py"], r"expected 'auto' or a whole number"),
        (["run", "--nproc", "2", "missing.py"], r"script 'missing.py' does not exist"),
        (["run", "-m", "no_such_module_xyz"], r"module 'no_such_module_xyz' cannot be found"),
        (["run", "--nnodes", "2", "x.py"], r"needs a meeting point.*--rdzv-endpoint"),
        (
            ["run", "--nnodes", "1:2", "--rdzv-endpoint", "h:1", "x.py"],
            r"--max-restarts is 0.*--max-restarts 3",
        ),
        (
            ["run", "--nnodes", "3:2", "--rdzv-endpoint", "h:1", "--max-restarts", "1", "x.py"],
            r"1 <= MIN <= MAX",
        ),
        (
            [
                "run",
                "--nnodes",
                "1:2",
                "--rdzv-endpoint",
                "h:1",
                "--max-restarts",
                "1",
                "--node-rank",
                "0",
                "x.py",
            ],
            r"elastic nodes get their ranks",
        ),
        (["run", "--nnodes", "one", "x.py"], r"expected N or MIN:MAX"),
    ],
)
def test_bad_command_lines_are_clear_errors(tmp_path: Path, args: list[str], message: str) -> None:
    (tmp_path / "x.py").write_text("")
    done = run_cli(*args, cwd=tmp_path, timeout=30)
    assert done.returncode == 2
    assert re.search(message, done.stderr), done.stderr


def test_elastic_command_line_for_torchrun(tmp_path: Path) -> None:
    from ddpkit.cluster.launch import LaunchConfig, torchrun_argv

    (tmp_path / "x.py").write_text("")
    common = dict(
        target=str(tmp_path / "x.py"), min_nodes=1, nnodes=4, rdzv_endpoint="10.0.0.1:29400", max_restarts=3
    )
    host = torchrun_argv(LaunchConfig(**common, local_addr="10.0.0.1", rdzv_conf="last_call_timeout=2"), 2)
    assert "--nnodes=1:4" in host and "--rdzv-backend=c10d" in host and "--local-addr=10.0.0.1" in host
    conf = next(a for a in host if a.startswith("--rdzv-conf="))
    assert "is_host=1" in conf and conf.endswith(
        "last_call_timeout=2"
    )  # the user's settings come last: they win
    other = torchrun_argv(LaunchConfig(**common, local_addr="10.0.0.2"), 2)
    assert "is_host=0" in next(a for a in other if a.startswith("--rdzv-conf="))
    fixed = {**common, "min_nodes": None, "nnodes": 2}  # --nnodes 2: the same decision of who hosts the store
    for addr, hosts in (("10.0.0.1", "is_host=1"), ("10.0.0.2", "is_host=0")):
        argv = torchrun_argv(LaunchConfig(**fixed, local_addr=addr, rdzv_conf="join_timeout=30"), 2)
        assert "--nnodes=2" in argv and f"--rdzv-conf={hosts},join_timeout=30" in argv, argv


def test_busy_explicit_port_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "x.py").write_text("")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        done = run_cli("run", "--nproc", "2", "--port", str(port), "x.py", cwd=tmp_path, timeout=30)
    assert done.returncode == 2 and f"port {port} is already in use" in done.stderr


def test_non_divisible_global_batch_stops_every_rank(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        import torch, ddpkit
        from torch.utils.data import TensorDataset
        with ddpkit.session() as s:
            s.loader(TensorDataset(torch.arange(100)), batch_size=31)
        """,
    )
    done = run_cli("run", "--nproc", "2", str(script), timeout=60)
    assert done.returncode != 0
    assert "global batch 31 is not divisible by world size 2" in done.stderr
    assert "e.g. 32" in done.stderr


def test_a_rank_that_raises_stops_the_job_promptly(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        import torch, ddpkit
        with ddpkit.session(timeout=300) as s:
            if s.rank == 1:
                raise ValueError("bad batch on rank 1")
            s.all_reduce(1.0)     # rank 0 waits here for a peer that never comes
        """,
    )
    start = time.monotonic()
    done = run_cli("run", "--nproc", "2", str(script), timeout=90)
    assert done.returncode == 1
    assert "ValueError: bad batch on rank 1" in done.stderr
    assert "rank 1" in done.stderr.splitlines()[-1]
    assert time.monotonic() - start < 80, "the waiting rank was not stopped"  # it would wait 300 s


def test_every_ranks_printed_lines_stay_whole_under_unbuffered_output(tmp_path: Path) -> None:
    # Both ranks write to their launcher's one stdout; with PYTHONUNBUFFERED (set by many CI systems and
    # by `python -u`) a plain print writes each argument and the newline apart, and lines interleave.
    # The same launch shows that `ddpkit run --device cpu` reaches the ranks' sessions.
    script = _script(
        tmp_path,
        "import ddpkit\nwith ddpkit.session() as s:\n    s.print('DEVICE', s.device)\n"
        "    for i in range(300):\n        s.print_all('x', i, 'y')\n",
    )
    done = run_cli(
        "run", "--nproc", "2", "--device", "cpu", str(script), timeout=60, env={"PYTHONUNBUFFERED": "1"}
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "DEVICE cpu" in done.stdout
    lines = [line for line in done.stdout.splitlines() if "x" in line]
    torn = [line for line in lines if not re.fullmatch(r"\[rank [01]\] x \d+ y", line)]
    assert len(lines) == 600 and not torn, torn[:5]


def rank_info(offset: int) -> tuple[int, int, int]:
    with ddpkit.session(verbose=False) as s:
        return s.rank, s.world_size, int(s.all_reduce(s.rank + offset).item())


def fails_on_rank_one() -> None:
    with ddpkit.session(verbose=False) as s:
        if s.rank == 1:
            raise KeyError("missing column")
        s.barrier()


# The ranks are forked (as "auto" starts a notebook's function), not new interpreters (~5 s of CPU each
# for imports): what these tests check, the results and the failure report, does not depend on how the
# ranks start; "auto" starting new interpreters for a module's function is test_warmstart's last spawn.
def test_spawn_returns_results_in_rank_order() -> None:
    assert ddpkit.spawn(rank_info, nproc=2, args=(10,), timeout=60, start_method="fork") == [
        (0, 2, 21),
        (1, 2, 21),
    ]
    assert not dist.is_initialized(), "the parent never joins the group"


def test_spawn_names_the_failing_rank() -> None:
    with pytest.raises(ddpkit.SpawnError, match=r"rank 1 of 2 failed:\nKeyError: 'missing column'"):
        ddpkit.spawn(fails_on_rank_one, nproc=2, timeout=60, start_method="fork")


def test_spawn_refuses_what_cannot_be_sent() -> None:
    with pytest.raises(ddpkit.DdpkitError, match="define it at the top level"):
        ddpkit.spawn(lambda: 1, nproc=2, start_method="spawn")  # "auto" forks for it (test_notebooks.py)


def test_the_users_threads_and_port_win_and_more_cpu_ranks_than_cores_warns_once(tmp_path: Path) -> None:
    # One launch, three settings of the user's: OMP_NUM_THREADS (more than the default of cores / 2
    # ranks, so the ranks show whose it is), which over-subscribes the cores (warned once), and --port
    # (the ranks' MASTER_PORT)
    from ddpkit.cluster.launch import oversubscription

    assert oversubscription(2, "1", 2) is None and oversubscription(1, "2", 2) is None
    text = oversubscription(4, "1", 2)
    assert text and "4 processes x 1 thread(s) on 2 CPU core(s)" in text and "--nproc 2" in text
    assert "1.75-2.7x slower" in (oversubscription(2, "2", 2) or "")
    script = _script(tmp_path, PLAIN_TORCHRUN_SCRIPT)
    threads = max(2, len(os.sched_getaffinity(0)))  # 2 x threads > cores; the default would be cores // 2
    port = _free_port()
    done = run_cli(
        "run",
        "--nproc",
        "2",
        "--port",
        str(port),
        str(script),
        env={"OUT_DIR": str(tmp_path), "OMP_NUM_THREADS": str(threads)},
    )
    assert done.returncode == 0, done.stderr
    assert {r["threads"] for r in _ranks(tmp_path)} == {threads}
    assert done.stderr.count(f"ddpkit run: warning: 2 processes x {threads} thread(s)") == 1
    assert _ranks(tmp_path)[0]["master"][1] == str(port)


@pytest.mark.parametrize(
    ("mode", "loop", "accumulation", "batch"),
    [
        ("per-rank", "accumulate", 2, 4),
        ("accumulation", "accumulate", 1, 8),
        ("auto", "step", 1, 8),
        ("auto", "plain", 1, 8),
    ],
)
def test_an_elastic_job_below_its_largest_size_keeps_the_global_batch(
    tmp_path: Path, mode: str, loop: str, accumulation: int, batch: int
) -> None:
    # One node of an elastic job of up to 2 (one rank each): world 1 of up to 2. The global batch (8)
    # stays: per-rank keeps 4 samples per rank and accumulates 2 micro-batches; --elastic-batch
    # accumulation grows the per-rank batch to 8 instead, and so does auto (the default) for a session
    # without accumulation=, whose loop may not accumulate at all: `s.backward; s.step` without a block,
    # or the README's first loop (issue 32). No network namespaces: the second node never comes, the
    # rendezvous closes 1 s after the first.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tmp_path / "out"
    out.mkdir()
    done = run_cli(
        "run",
        "--nnodes",
        "1:2",
        "--nproc",
        "1",
        "--max-restarts",
        "1",
        "--elastic-batch",
        mode,
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-conf",
        "last_call_timeout=1",
        str(REPO / "tests" / "elastic_train.py"),
        str(tmp_path / "ck"),
        str(out),
        "--sleep",
        "0",
        "--loop",
        loop,
        timeout=90,
        env={"OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    if mode == "auto":
        assert "elastic: world size 1 of up to 2: the per-rank batch grows 2x" in done.stdout, done.stdout
    steps = [tuple(map(int, line.split())) for line in (out / "steps.txt").read_text().splitlines()]
    assert len(steps) == 24, "96 samples / global batch 8 x 2 epochs"
    assert {(world, acc, size) for world, acc, _, size in steps} == {(1, accumulation, batch)}, steps[:3]


HANG = """
import time, ddpkit
with ddpkit.session() as s:
    print(f"rank {s.rank} hangs", flush=True)
    time.sleep(1000)  # a planted hang: a collective that never comes, a deadlock
"""


def test_a_timed_out_launch_leaves_no_worker_behind(tmp_path: Path) -> None:
    # torchrun starts each worker in a session of its own: killing the launcher (or its process group)
    # on a timeout would leave both ranks sleeping on, loading the rest of the suite's 2 cores.
    script = tmp_path / "hang.py"
    script.write_text(textwrap.dedent(HANG))
    tag = f"hang-{os.getpid()}-{time.monotonic_ns()}"
    proc, mark = popen_cli("run", "--nproc", "2", str(script), env={"DDPKIT_TEST_HANG": tag})
    try:
        hanging = 0
        while hanging < 2:  # both ranks reach the hang (pytest's timeout bounds this)
            line = proc.stdout.readline()
            assert line, "the launch ended before its ranks hung"
            hanging += line.count("hangs")  # under PYTHONUNBUFFERED two ranks' lines can share one
        with pytest.raises(subprocess.TimeoutExpired):
            communicate(proc, mark, timeout=1)  # run_cli's wait: the launch is past its limit
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher, should the test fail before its timeout
    left = marked(tag, var="DDPKIT_TEST_HANG")
    for pid in left:  # this test's own clean-up, so that a failure here does not leak either
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert left == [], f"{len(left)} process(es) of the timed-out launch outlived it: {left}"
