"""Every flag of `ddpkit bench collectives | scaling | tune` and `ddpkit trace` changes what is measured or
reported (tests/options/cli.toml).

The flags that say how long to measure (--rounds, --steps, --warmup, --block-seconds) have no effect on
the figures that a test could assert without asserting a timing, so they are checked by the work done:
`counting`, a tiny workload, records every loss it computes in a file named by the process, and the count
is what the flags ask for exactly (warmup + steps per block, one block per round). Each command runs once
on it, with every such flag set away from its default.

The ranks are the suite's pools (`ddpkit.spawn` routed to them, one rank in this process), as
tests/test_anatomy.py runs `ddpkit trace --ranks`: real gloo groups without starting interpreters.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import ddpkit
from ddpkit.bench import cli as bench_cli
from ddpkit.bench import report, runner, tune
from ddpkit.strategy.choice import verdict
from ddpkit.tools import trace
from ddpkit.tools.workloads import Workload

COUNT_DIR_ENV = "DDPKIT_TEST_COUNT_DIR"  # where `counting` records its builds and losses


def _record(kind: str) -> None:
    folder = os.environ.get(COUNT_DIR_ENV)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if folder and rank == 0:  # rank 0's work: every rank does the same
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"{kind}-{os.getpid()}"), "a") as f:
            f.write("x")


def _counted_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    _record("loss")
    return F.cross_entropy(out, target)


def _build() -> nn.Module:
    _record("build")
    return nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 6))


def _sample(g: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 32, generator=g), torch.randint(0, 6, (n,), generator=g)


def counting() -> Workload:
    """~21k parameters (84 KB: one DDP bucket by default, two at --bucket-cap-mb 0.03); global batch 8
    (1, 2 or 4 ranks)."""
    return Workload(
        name="counting",
        build=_build,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.01),
        sample=_sample,
        global_batch=8,
        loss=_counted_loss,
    )


def built_in(folder: Path, *, other_than_this_process: bool = False) -> list[str]:
    """The processes (their pids) that built the workload's model."""
    pids = [p.name.split("-")[1] for p in folder.glob("build-*")] if folder.exists() else []
    return [p for p in pids if not (other_than_this_process and p == str(os.getpid()))]


def losses(folder: Path) -> list[int]:
    """Losses computed by rank 0 of each process that computed any, in no particular order."""
    return sorted(len(p.read_text()) for p in folder.glob("loss-*"))


SPEC = "test_options_cli_tools:counting"


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    before = os.environ.copy()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(before)


def _in_env(env: dict[str, str], fn: Any, *args: Any) -> Any:
    """On a pool rank: `fn(*args)` in the environment a rank started by the command would have."""
    with _environ(env):
        return fn(*args)


@pytest.fixture
def on_pools(pool2, pool4, monkeypatch):
    """`ddpkit.spawn` on the suite's pools (2 or 4 ranks), or in this process for 1 rank with the threads
    asked for; the ranks see this process's DDPKIT_TEST_COUNT_DIR and the environment asked for."""

    def spawn(fn: Any, nproc: int, args: tuple = (), *, threads: int = 1, env: dict | None = None, **_: Any):
        env = {
            **({COUNT_DIR_ENV: os.environ[COUNT_DIR_ENV]} if COUNT_DIR_ENV in os.environ else {}),
            **(env or {}),
        }
        if nproc == 1:
            before = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                with _environ(env):
                    return [fn(*args)]
            finally:
                torch.set_num_threads(before)
        # the pools' ranks run one thread each: bench's own check refuses other counts there
        return {2: pool2, 4: pool4}[nproc].run(_in_env, env, fn, *args, timeout=120)

    monkeypatch.setattr(ddpkit, "spawn", spawn)


# -- ddpkit bench collectives -----------------------------------------------------------------------------
def test_collectives_sizes_ranks_threads_and_rounds(tmp_path: Path, capsys, on_pools) -> None:
    code = bench_cli.main(
        [
            "collectives",
            "--nproc",
            "2,4",
            "--threads",
            "2",
            "--min-size",
            "8KB",
            "--max-size",
            "32KB",
            "--rounds",
            "2",
            "--ops",
            "all_reduce",
            "--out",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    data = json.loads((tmp_path / "collectives.json").read_text())
    assert data["sizes"] == [8 << 10, 32 << 10] and list(data["worlds"]) == ["2", "4"]
    assert "4 ranks x 2 thread(s), 1 ops, 2 sizes, 2 rounds" in out, out


def test_collectives_timeout_stops_the_ranks(tmp_path: Path, capsys) -> None:
    args = ["collectives", "--max-size", "4KB", "--ops", "all_reduce", "--out", str(tmp_path)]
    # 0.5 s: 2 new interpreters cannot import torch that fast (10 ms can fail the store's own connection)
    assert bench_cli.main([*args, "--timeout", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "did not finish within" in err and "--timeout" in err and "Traceback" not in err, err


# -- ddpkit bench scaling -----------------------------------------------------------------------------------
def test_scaling_counts_buckets_hooks_and_the_work_per_block(
    tmp_path: Path, capsys, monkeypatch, on_pools
) -> None:
    monkeypatch.setenv(COUNT_DIR_ENV, str(tmp_path / "counts"))
    code = bench_cli.main(
        [
            "scaling",
            "--workload",
            SPEC,
            "--max-nproc",
            "4",
            "--buckets",
            "5",
            "--hooks",
            "fp16",
            "--rounds",
            "1",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--block-seconds",
            "0",
            "--verbose",
            "--out",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    data = json.loads((tmp_path / "scaling.json").read_text())
    assert [r["nproc"] for r in data["scaling"]] == [1, 2, 4]  # 3 does not divide the global batch
    swept = {o["label"] for o in data["options"] if o["label"].startswith(("bucket ", "hook "))}
    assert swept == {"bucket 5 MB", "hook fp16"}, data["options"]
    assert "workload counting" in out and "round 1/1 nproc 4:" in out, out
    # 1 warmup + 2 timed steps per block, one block per config and round, and with more than one rank
    # the same steps again without all-reduce (the communication share). Rank 0 of each group: this
    # process (nproc 1 and one process on every core: 3 + 3), 2 ranks (5), 4 ranks (nproc 4, the bucket
    # and the hook: 3 x 5)
    assert losses(tmp_path / "counts") == [5, 6, 15]


def test_scaling_threads_per_rank(tmp_path: Path, capsys, on_pools) -> None:
    cores = report.machine()["cores"]
    if cores == 1:
        pytest.skip("one core: --threads 1 is the default and the only count")
    args = ["scaling", "--workload", SPEC, "--max-nproc", "1", "--rounds", "1", "--steps", "1"]
    args += ["--warmup", "1", "--block-seconds", "0", "--out", str(tmp_path)]
    code = bench_cli.main([*args, "--threads", str(cores)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert [r["threads"] for r in json.loads((tmp_path / "scaling.json").read_text())["scaling"]] == [cores]
    assert "1 configurations x 1 rounds" in out, out  # no extra row of one process on every core


# -- ddpkit bench tune ------------------------------------------------------------------------------------
def test_tune_configurations_and_the_work_per_block(tmp_path: Path, capsys, monkeypatch, on_pools) -> None:
    monkeypatch.setenv(COUNT_DIR_ENV, str(tmp_path / "counts"))
    code = bench_cli.main(
        [
            "tune",
            "--workload",
            SPEC,
            "--nproc",
            "1",
            "--quick",
            "--rounds",
            "1",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--block-seconds",
            "0",
            "--verbose",
            "--json",
            str(tmp_path / "tune.json"),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    data = json.loads((tmp_path / "tune.json").read_text())
    assert data["workload"] == SPEC
    configs = data["configs"]
    assert len(configs) == len(tune.candidates(1, report.machine()["cores"], quick=True))
    assert {c["nproc"] for c in configs} == {1} and all(len(c["samples_s"]) == 1 for c in configs)
    assert "round 1/1 hand-written DDP (torch defaults):" in out, out
    assert sum(losses(tmp_path / "counts")) == 3 * len(configs)  # 1 warmup + 2 timed steps each


def _planted(fastest: str):
    """tune's measurement replaced by planted step times: `fastest` (a label's start) at 1 ms, the others
    at 10 ms. What tune decides from them is the command's own."""

    def measure(spec, configs, **_):
        stats = {}
        for c in configs:
            st = runner.Stats(c.label)
            st.samples.append(0.001 if c.label.startswith(fastest) else 0.010)
            stats[c.label] = st
        return stats

    return measure


def test_tune_lossy_fused_and_nodes_change_the_recommendation(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(tune, "measure", _planted("fp16 compression"))
    monkeypatch.setattr(tune, "floor_of", lambda *a: None)
    big = verdict(int(40e9), int(16e9), 2)  # 40 GB of model state, 16 GB per rank, 2 ranks per machine
    monkeypatch.setattr(tune, "memory_verdict", lambda workload, nproc: big)
    args = ["tune", "--workload", "cnn", "--nproc", "2", "--rounds", "1"]

    def run(*more: str) -> dict:
        assert bench_cli.main([*args, *more, "--json", str(tmp_path / "tune.json")]) == 0
        capsys.readouterr()
        return json.loads((tmp_path / "tune.json").read_text())

    strict = run()
    assert not strict["recommendation"]["label"].startswith("fp16")  # lossy: never without the flag
    assert run("--allow-lossy")["recommendation"]["label"] == "fp16 compression"
    assert not any(c["fused"] for c in strict["configs"])
    fused = [c["label"] for c in run("--fused")["configs"] if c["fused"]]
    assert "ddpkit defaults + fused optimizer" in fused
    assert strict["memory"]["shape"] != run("--nodes", "4")["memory"]["shape"]


# -- ddpkit trace -----------------------------------------------------------------------------------------
def test_trace_ranks_buckets_steps_and_warmup(tmp_path: Path, capsys, monkeypatch, on_pools) -> None:
    monkeypatch.setenv(COUNT_DIR_ENV, str(tmp_path / "counts"))
    code = trace.main(
        [
            "--workload",
            SPEC,
            "--nproc",
            "4",
            "--hook",
            "fp16",
            "--bucket-cap-mb",
            "0.03",
            "--warmup",
            "1",
            "--steps",
            "2",
            "--out",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    ranks = json.loads((tmp_path / "ranks.json").read_text())
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert len(ranks[0]["buckets"]) == 2, ranks[0]["buckets"]  # 84 KB in buckets of 30 KB (one by default)
    assert {e["step"] for e in ranks[0]["events"]} == {0, 1}
    assert losses(tmp_path / "counts") == [3]  # 1 warmup + 2 traced steps on rank 0


def test_trace_hook_is_the_hook_run(tmp_path: Path, on_pools) -> None:
    with pytest.raises(ddpkit.DdpkitError, match="--hook 'no-such-hook' is not a known"):  # before the ranks
        trace.main(["--workload", SPEC, "--hook", "no-such-hook", "--steps", "1", "--out", str(tmp_path)])
    argv = ["--workload", SPEC, "--hook", "fp16", "--warmup", "1", "--steps", "1", "--out", str(tmp_path)]
    assert trace.main(argv) == 0
    ranks = json.loads((tmp_path / "ranks.json").read_text())
    assert [r["hook"] for r in ranks] == ["fp16_compress_hook"] * 2, [r["hook"] for r in ranks]
