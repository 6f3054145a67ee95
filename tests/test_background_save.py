"""Background saves: the state is copied before the call returns, and a crash in the middle of the
write leaves the previous checkpoint the newest valid one (real processes, a real SIGKILL)."""

from __future__ import annotations

import contextlib
import io
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from torch import nn

import ddpkit

HW = ddpkit.Hardware(gpus=0, cpu_cores=2)


def test_a_background_save_holds_the_state_of_the_call_not_of_later_steps(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with ddpkit.session(env={}, hardware=HW, verbose=False) as s:
        path = s.save(tmp_path, model=model, optimizer=opt, step=1, background=True)
        with torch.no_grad():  # training goes on while the write is in flight
            for p in model.parameters():
                p.add_(1.0)
        s.checkpoints.wait()
        assert path == tmp_path / "ckpt-000001" and (path / "manifest.json").is_file()
        fresh = nn.Linear(64, 64)
        assert (
            s.load(tmp_path, model=fresh, optimizer=torch.optim.AdamW(fresh.parameters()), step=0)["step"]
            == 1
        )
    for key, value in want.items():
        assert fresh.state_dict()[key].equal(value), f"{key}: the save holds a later state"


JOB = """
import os, signal, sys, torch, ddpkit
from torch import nn
root = sys.argv[1]
with ddpkit.session(seed=0, strategy=sys.argv[3]) as s:
    model = s.model(nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)]))  # 8 MiB: a write takes a while
    opt = torch.optim.AdamW(model.parameters())
    values = s.load(root, model=model, optimizer=opt, step=0)
    if sys.argv[2] == "crash":
        s.save(root, model=model, optimizer=opt, step=1)
        s.save(root, model=model, optimizer=opt, step=2, background=sys.argv[4])
        if s.rank == 0:  # the committing rank dies while its write is in flight
            os.kill(os.getpid(), signal.SIGKILL)
        s.checkpoints.wait()
    print(f"STEP {values['step']}", flush=True)  # one string: ranks share the pipe
"""


@pytest.mark.parametrize(("strategy", "mode"), [("ddp", "thread"), ("fsdp", "thread"), ("ddp", "process")])
def test_a_crash_during_a_background_write_leaves_the_previous_checkpoint(
    pool2, tmp_path: Path, strategy: str, mode: str
) -> None:  # fsdp: the writer saves copied shards; process: a writer process writes the big files
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB))
    root = tmp_path / "ck"
    crashed = run_cli("run", "--nproc", "2", str(script), str(root), "crash", strategy, mode, timeout=50)
    assert crashed.returncode != 0 and "SIGKILL" in crashed.stderr, crashed.stderr[-2000:]
    # The survivor ends at once: at the agent's SIGTERM (DDP: it waits for the dead rank's commit
    # through the store) or by its own error (FSDP: DCP's collective sees the peer gone). It must not
    # take the agent's SIGTERM for a preemption and live on until the agent's SIGKILL 30 s later.
    ended = [f"the others were stopped {how}" in crashed.stderr for how in ("(1 by SIGTERM)", "(1 raised)")]
    assert any(ended), crashed.stderr[-2000:]
    assert "preempted" not in crashed.stdout + crashed.stderr
    assert (root / "ckpt-000001").is_dir() and not (root / "ckpt-000002").exists()
    assert (root / ".ckpt-000002.tmp").is_dir(), "the background write was not in flight"
    # the job resumed: its load on the pool's ranks (a second launch would only repeat the first's start)
    (step, said), (step_1, _) = pool2.run(resume, str(root), strategy, timeout=60)
    assert "ignored .ckpt-000002.tmp: a save that never finished" in said, said
    assert "resumed from" in said and "ckpt-000001 (step 1)" in said, said
    assert step == step_1 == 1


def resume(root: str, strategy: str) -> tuple[int, str]:
    """On a pool rank: JOB's model and optimizer loaded from `root`; the step and what the session printed
    (rank 0's lines; none on the others)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), ddpkit.session(seed=0, strategy=strategy) as s:
        model = s.model(nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)]))
        opt = torch.optim.AdamW(model.parameters())
        step = s.load(root, model=model, optimizer=opt, step=0)["step"]
    return step, out.getvalue()


def sharded_saves(root: str, mode: str) -> dict:
    """Rank r of a sharded step (shard_optimizer=True: each rank holds a share of AdamW's state): a
    synchronous save, then a background one (`mode`) while training changes the weights and the optimizer
    state; on rank 0, whether the two checkpoints' files hold the same tensors and tree."""
    import json

    from safetensors.torch import load_file

    with ddpkit.session(seed=0, shard_optimizer=True, verbose=False) as s:
        model = s.model(nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)]))
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        for _ in range(2):
            s.backward(model(torch.randn(8, 64)).square().mean())
            s.step(opt)
        sync = s.save(f"{root}/sync", model=model, optimizer=opt, step=2)
        background = s.save(f"{root}/background", model=model, optimizer=opt, step=2, background=mode)
        with torch.no_grad():  # training goes on: neither the weights nor the optimizer state may leak in
            for p in model.parameters():
                p.add_(1.0)
            for st in opt.state.values():
                for v in st.values():
                    v.add_(1.0)
        s.checkpoints.wait()
        if s.rank != 0:
            return {}
        a, b = (load_file(str(p / "state.safetensors")) for p in (sync, background))
        same = a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
        trees = [json.loads((p / "state.json").read_text()) for p in (sync, background)]
        return {"keys": len(a), "same": same and trees[0] == trees[1]}


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_a_background_save_of_a_sharded_step_holds_the_whole_optimizer_state(
    pool2, tmp_path: Path, mode: str
) -> None:
    """The writer gathers the ranks' shares (not the call): the files equal a synchronous save's."""
    got = pool2.run(sharded_saves, str(tmp_path), mode, timeout=120)[0]
    assert got == {"keys": 24, "same": True}, got


def test_the_writer_threads_safetensors_file_is_one_safetensors_reads_with_its_hash(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from ddpkit.checkpoint import files
    from ddpkit.checkpoint.write import stream_tensors

    tensors = {
        "w": torch.randn(300, 70),
        "step": torch.tensor(3.0),
        "empty": torch.zeros(0, 4),
        "half": torch.randn(9, dtype=torch.bfloat16),
        "ids": torch.arange(11),
        "mask": torch.tensor([True, False, True]),
    }
    entry = stream_tensors(tmp_path / "x.safetensors", tensors)
    assert entry == files.describe_file(tmp_path / "x.safetensors")  # size and SHA-256 of the bytes on disk
    back = load_file(str(tmp_path / "x.safetensors"))
    assert back.keys() == tensors.keys()
    for key, value in tensors.items():
        assert back[key].dtype == value.dtype and back[key].equal(value), key


def test_an_fsdp_background_save_is_the_state_of_the_call(pool2, tmp_path: Path) -> None:
    from fsdp_train import background_save_and_load

    for result in pool2.run(background_save_and_load, str(tmp_path / "ck")):
        assert result["async"], "the shards were not copied for the writer (checkpoint_dcp.stage)"
        assert result["changed_after"], "training did not go on while the write was in flight"
        assert result["differ"] == [], result["differ"]  # loaded == the state at the call, bitwise


def test_the_writer_thread_runs_at_idle_priority() -> None:
    """It takes no CPU time from training ranks that fill the cores (ddpkit.checkpoint.background)."""
    import os

    from ddpkit.checkpoint.background import Background

    writer = Background()
    writer.run(lambda: os.sched_getscheduler(0))  # 0: the calling thread, here the writer
    writer.wait()
    assert writer.result == os.SCHED_IDLE
    assert os.sched_getscheduler(0) != os.SCHED_IDLE  # the training thread keeps its priority
