"""The effect of each Python API option that no other test shows: what a user sees change when they pass it.

Each test fails when its option is ignored (the default used instead); tests/options/api.toml names them.
Session, loader, checkpoint and fit options, in one process where the option is visible there (real files,
a real fit loop), on the shared two-rank pool where it needs a second rank. The strategies' options (DDP,
FSDP, HSDP): tests/test_options_api_strategies.py.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_marked
from recording import Recorder
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.errors import DdpkitError

CPU = ddpkit.Hardware(gpus=0, cpu_cores=2)
ONE_GPU = ddpkit.Hardware(gpus=1, cpu_cores=16)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _torchrun(rank: int, world: int, port: int) -> dict[str, str]:
    """What torchrun sets for rank `rank` of `world` on one node."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


# -- ddpkit.session -----------------------------------------------------------------------------------------


@pytest.mark.numerics
def test_seed_decides_the_initial_weights() -> None:
    """Every rank builds its model after `session(seed=)` seeded the generators: the same seed gives the same
    weights, another seed other weights."""

    def weights(seed: int) -> torch.Tensor:
        with ddpkit.session(seed=seed, env={}, hardware=CPU, verbose=False):
            return nn.Linear(8, 8).weight.detach().clone()

    assert torch.equal(weights(1), weights(1))
    assert not torch.equal(weights(1), weights(2)), "seed= did not reach the generators"


def test_device_cpu_is_kept_on_a_machine_with_a_gpu() -> None:
    """`device="cpu"` on hardware with a GPU: the session trains on the CPU ("auto" would take the GPU)."""
    with ddpkit.session(device="cpu", hardware=ONE_GPU, env={}, verbose=False) as s:
        assert s.device.type == "cpu" and s.plan.mode == "single-cpu"


@pytest.mark.parametrize(
    ("kwargs", "env", "says"),
    [
        ({"backend": "nccl", "hardware": CPU}, {}, r"backend 'nccl' needs GPUs but the plan runs on the CPU"),
        (
            {"share_gpu": True, "hardware": CPU},
            {},
            r"share_gpu=True \(--share-gpu\) puts ranks on a shared GPU",
        ),
        (
            {"hardware": ONE_GPU, "rendezvous_timeout": 5},
            _torchrun(0, 2, 1),
            r"2 processes on this node \(world size 2\) but only 1 GPU\(s\)",
        ),
    ],
    ids=["backend", "share_gpu", "hardware"],
)
def test_placement_options_reach_the_plan(kwargs: dict, env: dict, says: str) -> None:
    """The plan is made from these options (the table of plans: tests/test_topology.py); each shows here by
    the one refusal it alone causes on this machine: NCCL on CPU ranks, a shared GPU without a GPU, and two
    ranks on a node whose hardware= has one GPU."""
    with pytest.raises(DdpkitError, match=says), ddpkit.session(env=env, verbose=False, **kwargs):
        pass


ALONE = """
import ddpkit
try:
    with ddpkit.session(rendezvous_timeout=2, device="cpu", verbose=False):
        print("met")
except RuntimeError as exc:
    print(f"gave up: {exc}")
"""


def test_rendezvous_timeout_bounds_the_wait_for_a_missing_rank() -> None:
    """Rank 0 of 2 alone: the start-up meeting gives up after rendezvous_timeout, not the default 600 s (a
    process of its own: a wait in the store's native code is not interrupted by pytest's timeout)."""
    env = {**os.environ, **_torchrun(0, 2, _free_port())}
    done = run_marked([sys.executable, "-c", ALONE], timeout=40, env=env)  # a bound on a hang only
    assert "gave up: " in done.stdout and "only 1 of the 2 ranks reached it" in done.stdout, (
        done.stdout + done.stderr[-2000:]
    )


def slow_save(root: str, save_timeout: float) -> str:
    """Rank 0's manifest takes 3 s to write; rank 1 waits for it through the store up to save_timeout."""
    from ddpkit.checkpoint import files

    real = files.write_manifest
    with ddpkit.session(save_timeout=save_timeout, verbose=False) as s:
        if s.rank == 0:
            files.write_manifest = lambda *a: (time.sleep(3), real(*a))[1]
        try:
            s.save(root, step=1)
            said = "saved"
        except DdpkitError as exc:
            said = str(exc)
        finally:
            files.write_manifest = real
        s.barrier()  # rank 0 finishes its write before either leaves
        return said


def test_save_timeout_bounds_the_wait_for_rank_0s_write(pool2, tmp_path: Path) -> None:
    r0, r1 = pool2.run(slow_save, str(tmp_path / "ck"), 1.0, timeout=60)
    assert r0 == "saved"
    assert (
        r1.startswith("gave up after 1 s waiting for rank 0 to write checkpoint 1") and "save_timeout=" in r1
    ), r1
    r0, r1 = pool2.run(slow_save, str(tmp_path / "ck2"), 60.0, timeout=60)
    assert (r0, r1) == ("saved", "saved")


def test_chunk_sets_the_forwards_of_an_any_world_step() -> None:
    """`reproducible="any-world"` runs the global batch as chunks of `chunk` samples, one forward each."""

    def forwards(chunk: int) -> int:
        with ddpkit.session(reproducible="any-world", chunk=chunk, env={}, hardware=CPU, verbose=False) as s:
            model = s.model(nn.Linear(4, 2))
            calls = [0]
            ddpkit.unwrap(model).register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            data = TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
            batch = next(iter(s.loader(data, batch_size=8)))
            s.invariant.step(model, opt, batch, lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]))
            return calls[0]

    assert (forwards(2), forwards(4)) == (4, 2)


# -- Session.loader -----------------------------------------------------------------------------------------


def loader_shapes() -> dict[str, Any]:
    """Per-rank batch sizes and batch counts of s.loader under each option, on this rank."""
    with ddpkit.session(seed=0, verbose=False) as s:
        data = TensorDataset(torch.arange(20))

        def sizes(loader: Any) -> list[int]:
            return [len(batch) for (batch,) in loader]

        return {
            "batch_size": sizes(s.loader(data, batch_size=8)),
            "per_rank": sizes(s.loader(data, per_rank_batch_size=3)),
            "drop_last": sizes(s.loader(data, batch_size=8, drop_last=True)),
            "split": [int(i) for (b,) in s.loader(data, batch_size=4) for i in b],
            "presplit": [int(i) for (b,) in s.loader(data, batch_size=4, presplit=True) for i in b],
        }


def test_loader_batch_options_change_the_batches_each_rank_gets(pool2) -> None:
    """batch_size is the global batch (8: 4 per rank); per_rank_batch_size is each rank's (3); drop_last
    drops the global tail of 20 % 8 samples; presplit=True reads the rank's dataset whole, never split."""
    r0, r1 = pool2.run(loader_shapes)
    for r in (r0, r1):
        assert r["batch_size"][:2] == [4, 4] and len(r["batch_size"]) == 3
        assert r["per_rank"][:3] == [3, 3, 3] and len(r["per_rank"]) == 4  # 20 / (2 x 3): 4 steps
        assert r["drop_last"] == [4, 4], r["drop_last"]
        assert sorted(r["presplit"]) == list(range(20)), "presplit=True was split again"
        assert len(r["split"]) == 10
    assert not set(r0["split"]) & set(r1["split"])


# -- Session.save / Session.load ----------------------------------------------------------------------------


def _steps(root: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in root.glob("ckpt-*"))


def test_save_every_n_writes_only_at_multiples_of_n(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    with ddpkit.session(env={}, hardware=CPU, verbose=False) as s:
        written = [s.save(tmp_path, model=model, step=step, every=3, keep=10) for step in range(1, 8)]
        assert [w is not None for w in written] == [False, False, True, False, False, True, False]
        assert len(_steps(tmp_path)) == 2 and s.load(tmp_path, model=model, step=0)["step"] == 6


class _Wider(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.extra = nn.Linear(2, 2)  # not in the checkpoint


@pytest.mark.numerics
def test_load_strict_false_loads_a_model_with_keys_the_checkpoint_lacks(tmp_path: Path) -> None:
    saved = nn.Sequential()
    saved.lin = nn.Linear(2, 2)
    with ddpkit.session(env={}, hardware=CPU, verbose=False) as s:
        s.save(tmp_path, model=saved, step=1)
        wider = _Wider()
        with pytest.raises(Exception, match="extra"):
            s.load(tmp_path, model=_Wider(), step=0)  # strict (the default): the missing key is an error
        assert s.load(tmp_path, model=wider, step=0, strict=False)["step"] == 1
    assert torch.equal(wider.lin.weight, saved.lin.weight)


# -- ddpkit.fit ---------------------------------------------------------------------------------------------


class _LearningRates(ddpkit.Callback):
    def __init__(self) -> None:
        self.seen: list[float] = []

    def on_step_end(self, state: Any) -> None:
        self.seen.append(state.optimizer.param_groups[0]["lr"])


def _fit(tmp_path: Path, **options: Any) -> dict[str, Any]:
    """fit in one process: 2 epochs of 4 steps; what it returned, logged, tracked and the lr after each step."""
    recorder, rates = Recorder(), _LearningRates()
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 6, generator=g), torch.randint(0, 2, (32,), generator=g))
    log = tmp_path / "log.jsonl"
    with ddpkit.session(seed=0, env={}, hardware=CPU, verbose=False, log_to=[recorder]) as s:
        model = s.model(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2)))
        start = [p.detach().clone() for p in model.parameters()]
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        more = {"scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}
        result = ddpkit.fit(
            s,
            model,
            opt,
            s.loader(data, batch_size=8),
            lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]),
            epochs=2,
            log=log,
            callbacks=[rates],
            **{"progress": False, "track_every": 1, **more, **options},
        )
        moved = (
            sum((a - b.detach()).norm() ** 2 for a, b in zip(start, model.parameters(), strict=True)) ** 0.5
        )
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    return {
        "result": result,
        "rows": [r for r in rows if r["phase"] == "train"],
        "tracked": recorder.seen,
        "lr": rates.seen,
        "moved": float(moved),
    }


def test_fit_scheduler_interval_epoch_steps_the_schedule_once_an_epoch(tmp_path: Path) -> None:
    assert _fit(tmp_path, scheduler_interval="epoch")["lr"] == [0.1] * 4 + [0.05] * 4
    assert _fit(tmp_path / "step")["lr"] == [0.1 * 0.5**i for i in range(1, 9)]  # halving is exact


def test_fit_log_every_writes_a_row_every_n_steps(tmp_path: Path) -> None:
    assert [r["step"] for r in _fit(tmp_path, log_every=2)["rows"]] == [2, 4, 6, 8]
    assert [r["step"] for r in _fit(tmp_path / "one")["rows"]] == list(range(1, 9))


def test_fit_progress_prints_the_progress_line_or_nothing(tmp_path: Path, capsys) -> None:
    _fit(tmp_path, progress=True)
    assert "fit: step 8/8 (100%), epoch 1" in capsys.readouterr().out
    _fit(tmp_path / "quiet", progress=False)
    assert capsys.readouterr().out == ""


def test_fit_flops_given_or_none_replaces_the_count(tmp_path: Path, monkeypatch) -> None:
    """flops=N: the model FLOPs per step are N (no count); None: no FLOP/s and no MFU anywhere."""
    monkeypatch.setenv("DDPKIT_CACHE_DIR", str(tmp_path))  # the CPU's measured peak, cached per machine
    given = _fit(tmp_path / "given", flops=1e9)
    assert given["result"].anatomy["flops_per_step"] == 1e9 and given["rows"][-1]["flops_per_step"] == 1e9
    none = _fit(tmp_path / "none", flops=None)
    assert none["result"].anatomy["flops_per_step"] is None
    assert not [k for r in none["rows"] for k in r if "flops" in k or k == "mfu"]
    assert not [k for _, values in none["tracked"] for k in values if "flops" in k or k == "mfu"]


def test_fit_anatomy_every_sets_the_steps_between_the_ranks_gathers(tmp_path: Path) -> None:
    def gathered(run: dict) -> list[int]:
        return [step for step, values in run["tracked"] if any(k.startswith("anatomy/") for k in values)]

    every2 = _fit(tmp_path, anatomy_every=2, flops=None)
    assert gathered(every2) == [2, 4, 6, 8] and every2["result"].anatomy["ranks"]
    default = _fit(tmp_path / "default", flops=None)  # 10: no gather in 8 steps
    assert gathered(default) == [] and default["result"].anatomy["ranks"] == []


def test_fit_max_norm_clips_the_gradient_it_reports(tmp_path: Path) -> None:
    """max_norm: the step's gradient is clipped to it (the weights move by at most lr x max_norm) and its
    norm before clipping is reported; without it no norm is taken."""
    clipped = _fit(tmp_path, max_norm=1e-3, scheduler=None)
    assert all(values["grad_norm"] > 1e-3 for _, values in clipped["tracked"])
    assert clipped["moved"] <= 8 * 0.1 * 1e-3 * (1 + 1e-4), clipped["moved"]  # 8 steps of lr 0.1
    free = _fit(tmp_path / "free", scheduler=None)
    assert not [v for _, v in free["tracked"] if "grad_norm" in v]
    assert free["moved"] > 10 * clipped["moved"]
