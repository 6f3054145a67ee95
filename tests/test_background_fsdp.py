"""Background saves under FSDP (copied shards, saved by the writer thread with DCP; with background="process"
each rank's DCP file written by its writer process) and the pinned CPU copy: real torchrun and the shared
gloo rank pools, a real SIGKILL while DCP's thread writes, and of a writer process mid-save."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import run_cli

from ddpkit.checkpoint.background import lower_priority
from ddpkit.checkpoint.write import to_cpu

JOB = """
import os, signal, sys, torch, ddpkit
from torch import nn
root, mode, out = sys.argv[1], sys.argv[2], sys.argv[3]
with ddpkit.session(seed=0) as s:
    model = s.model(nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)]), strategy="fsdp")
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    values = s.load(root, model=model, optimizer=opt, step=0)

    def full():  # every weight whole (a collective)
        sd = ddpkit.unwrap(model).state_dict()
        return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in sd.items()}

    def full_opt():  # AdamW's moments and step count, whole (a collective), by parameter order
        return {f"{i}.{k}": (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                for i, p in enumerate(model.parameters()) for k, v in opt.state[p].items() if torch.is_tensor(v)}

    if mode == "save":
        s.backward(model(torch.randn(4, 256)).square().mean())
        s.step(opt)
        want, want_opt = full(), full_opt()
        s.save(root, model=model, optimizer=opt, step=1, background=True)
        with torch.no_grad():  # training goes on while DCP's thread writes: weights and optimizer state
            for p in model.parameters():
                p.add_(1.0)
            for state in opt.state.values():
                for v in state.values():
                    if torch.is_tensor(v):
                        v.add_(1.0)
        s.checkpoints.wait()
        torch.save({"model": want, "opt": want_opt}, f"{out}/want.pt")
    elif mode == "crash":
        s.save(root, model=model, optimizer=opt, step=1)
        s.save(root, model=model, optimizer=opt, step=2, background=True)
        if s.rank == 0:  # the committing rank dies while the shards are written
            os.kill(os.getpid(), signal.SIGKILL)
        s.checkpoints.wait()
    elif mode == "load":
        want = torch.load(f"{out}/want.pt")
        got, got_opt = full(), full_opt()
        s.print("SAME" if all(got[k].equal(want["model"][k]) for k in want["model"]) else "DIFFERENT")
        same = got_opt.keys() == want["opt"].keys() and all(got_opt[k].equal(want["opt"][k]) for k in got_opt)
        s.print("OPTIMIZER " + ("SAME" if same and got_opt else "DIFFERENT"))
    s.print(f"STEP {values['step']}")  # rank 0 only: two ranks' lines interleave in one pipe
"""


LAUNCH_TIMEOUT = 50  # each launch takes 6-12 s here; two per test stay under pytest's 120 s


def _script(tmp_path: Path) -> Path:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB))
    return script


def test_a_background_fsdp_save_loads_the_weights_and_optimizer_state_of_the_call(tmp_path: Path) -> None:
    script, root = _script(tmp_path), tmp_path / "ck"
    saved = run_cli("run", "--nproc", "2", str(script), str(root), "save", str(tmp_path), timeout=LAUNCH_TIMEOUT)
    assert saved.returncode == 0, saved.stderr[-3000:]
    assert (root / "ckpt-000001" / "dcp" / ".metadata").is_file()
    loaded = run_cli("run", "--nproc", "2", str(script), str(root), "load", str(tmp_path), timeout=LAUNCH_TIMEOUT)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert "STEP 1" in loaded.stdout and "\nSAME" in loaded.stdout, loaded.stdout
    assert "OPTIMIZER SAME" in loaded.stdout, "the optimizer state was saved as it was after the call"


def test_a_crash_during_a_background_fsdp_write_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    script, root = _script(tmp_path), tmp_path / "ck"
    crashed = run_cli("run", "--nproc", "2", str(script), str(root), "crash", str(tmp_path), timeout=LAUNCH_TIMEOUT)
    assert crashed.returncode != 0 and "SIGKILL" in crashed.stderr, crashed.stderr[-2000:]
    assert (root / "ckpt-000001").is_dir() and not (root / "ckpt-000002").exists()
    assert (root / ".ckpt-000002.tmp").is_dir(), "the background write was not in flight"
    resumed = run_cli("run", "--nproc", "2", str(script), str(root), "resume", str(tmp_path), timeout=LAUNCH_TIMEOUT)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "ignored .ckpt-000002.tmp: a save that never finished" in resumed.stdout, resumed.stdout
    assert "ckpt-000001 (step 1)" in resumed.stdout


def test_gpu_tensors_are_copied_to_pinned_memory_cpu_tensors_left_for_the_clone() -> None:
    fresh: set[int] = set()
    cpu = torch.ones(3)
    tree = to_cpu({"a": cpu, "b": [cpu, 2]}, fresh)
    assert tree["a"] is cpu and tree["b"][0] is cpu and tree["b"][1] == 2 and not fresh
    if not torch.cuda.is_available():
        pytest.skip("no GPU: the pinned path (torch.empty(pin_memory=True) + copy_(non_blocking)) is not run")
    gpu = torch.arange(4.0, device="cuda")
    copied = to_cpu({"g": gpu}, fresh)["g"]
    torch.cuda.synchronize()
    assert copied.device.type == "cpu" and copied.is_pinned() and copied.equal(gpu.cpu()) and len(fresh) == 1


def test_the_writer_thread_runs_at_the_lowest_priority() -> None:
    import os
    import threading

    seen: list[int] = []

    def body() -> None:
        lower_priority()
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen == [19]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) != 19, "the caller was niced"


# -- background="process" under FSDP: the writer process writes each rank's DCP file (shared rank pools) --


def _fsdp(s, width: int = 64):  # the smallest FSDP job that has sharded weights and sharded AdamW moments
    from torch import nn

    torch.manual_seed(0)
    model = s.model(nn.Sequential(nn.Linear(width, width), nn.Linear(width, 64), nn.Linear(64, 8)), strategy="fsdp")
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    s.backward(model(torch.randn(4, width)).square().mean())
    s.step(opt)
    return model, opt


def _shards(model, opt) -> dict[str, torch.Tensor]:
    """This rank's shards of the weights and of AdamW's state, copied (no collective)."""
    local = {f"w.{k}": v.to_local().clone() for k, v in model.state_dict().items()}
    for i, p in enumerate(model.parameters()):
        local |= {f"opt.{i}.{k}": (v.to_local() if hasattr(v, "to_local") else v).clone()
                  for k, v in opt.state[p].items()}  # fmt: skip
    return local


def _wchar(pid: int) -> int:
    """The bytes process `pid` has written (/proc/PID/io), as a user would read them."""
    return int(dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())["wchar"])


def process_save(root: str) -> dict:
    """Rank r: a process save under FSDP while training changes the state; what the writer process wrote,
    and whether a fresh model and optimizer loaded from it hold the shards of the call, bit for bit."""
    import ddpkit

    with ddpkit.session(seed=0, verbose=False) as s:
        model, opt = _fsdp(s)
        want = _shards(model, opt)
        path = s.save(root, model=model, optimizer=opt, step=1, background="process")
        with torch.no_grad():  # training goes on while the shards are written
            for p in model.parameters():
                p.add_(1.0)
            for state in opt.state.values():
                for v in state.values():
                    v.add_(1.0)
        s.checkpoints.wait()
        writer = s.checkpoints._process.process.pid
        wrote = _wchar(writer)
        fresh, fresh_opt = _fsdp(s)
        step = s.load(root, model=fresh, optimizer=fresh_opt, step=0)["step"]
        got = _shards(fresh, fresh_opt)
        same = got.keys() == want.keys() and all(got[k].equal(want[k]) for k in want)
        mine = Path(path) / "dcp" / f"__{s.rank}_0.distcp"
        return {"step": step, "same": same, "writer": writer, "me": os.getpid(), "writer_wrote": wrote,
                "file": mine.stat().st_size, "path": str(path),
                "weights": {k: v for k, v in want.items() if k.startswith("w.")}}  # fmt: skip


# The writer process imports torch at its first FSDP save, at idle priority: slow on a loaded machine.
@pytest.mark.timeout(240)
def test_a_process_save_under_fsdp_is_written_by_the_writer_process_and_resumes_bitwise(pool2, tmp_path: Path) -> None:
    from ddpkit.checkpoint.inspect import report

    ranks = pool2.run(process_save, str(tmp_path / "ck"), timeout=180)
    for rank, got in enumerate(ranks):
        assert got["step"] == 1 and got["same"], f"rank {rank}: not the shards of the call: {got}"
        assert got["writer"] != got["me"]
        # the rank's DCP file went out through its writer process, not through training's
        assert got["writer_wrote"] >= got["file"] > 0, f"rank {rank}: its writer process did not write its shards"
    text, ok = report(ranks[0]["path"])
    assert ok, text  # every checksum in the manifest holds: what `ddpkit checkpoint inspect` checks
    # and DCP reshards it like any FSDP checkpoint: one process (here) loads the whole weights, which are the
    # two ranks' dim-0 shards at the call, joined
    from torch import nn

    import ddpkit

    with ddpkit.session(seed=0, verbose=False) as s:
        one = s.model(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 8)), strategy="fsdp")
        assert s.load(str(tmp_path / "ck"), model=one, step=0)["step"] == 1
    for k, v in one.state_dict().items():
        joined = torch.cat([ranks[0]["weights"][f"w.{k}"], ranks[1]["weights"][f"w.{k}"]])
        assert v.equal(joined), f"{k}: one process did not load the two ranks' shards"


def killed_writer(root: str) -> dict:
    """Rank r: a checkpoint, then a process save whose writer process on rank 1 is killed mid-save; what
    each rank saw, what the folder holds, and whether the next save (a new writer) commits."""
    import signal

    import ddpkit
    from ddpkit.checkpoint.checkpoints import latest

    with ddpkit.session(seed=0, verbose=False) as s:
        model, opt = _fsdp(s)
        s.save(root, model=model, optimizer=opt, step=1, background="process")
        s.checkpoints.wait()
        writer = s.checkpoints._process.process.pid
        if s.rank == 1:
            os.kill(writer, signal.SIGSTOP)  # its next write is held...
        s.save(root, model=model, optimizer=opt, step=2, background="process")
        if s.rank == 1:
            os.kill(writer, signal.SIGKILL)  # ...and it dies during the save (before or inside the write)
        try:
            s.checkpoints.wait()
            error = ""
        except Exception as err:
            error = f"{type(err).__name__}: {err}"
        s.barrier()
        after = sorted(p.name for p in Path(root).iterdir())
        newest = latest(Path(root)).name
        step = s.load(root, model=model, optimizer=opt, step=0)["step"]
        path = s.save(root, model=model, optimizer=opt, step=3, background="process")
        s.checkpoints.wait()
        return {"error": error, "after": after, "newest": newest, "step": step, "next": Path(path).name,
                "new_writer": s.checkpoints._process.process.pid != writer}  # fmt: skip


@pytest.mark.timeout(240)
def test_a_killed_fsdp_writer_process_fails_the_save_on_every_rank_and_loses_no_checkpoint(pool2, tmp_path: Path) -> None:
    ranks = pool2.run(killed_writer, str(tmp_path / "ck"), timeout=180)
    assert "killed by signal 9" in ranks[1]["error"], ranks[1]["error"]
    assert ranks[0]["error"], "rank 0 committed (or did not report) a save that rank 1's writer never finished"
    for got in ranks:
        assert got["after"] == ["ckpt-000001"] and got["newest"] == "ckpt-000001", got  # partial files removed
        assert got["step"] == 1, got
        assert got["next"] == "ckpt-000002", got  # the next save commits...
    assert ranks[1]["new_writer"] and not ranks[0]["new_writer"]  # ...with a new writer where one was killed



# -- background=True under FSDP: the writer thread hashes DCP's file as it writes it, from a reused copy --


def _rchar() -> int:
    """The bytes this process has read (/proc/self/io: every thread's, ended ones too)."""
    return int(dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())["rchar"])


def thread_saves(root: str) -> dict:
    """Rank r: two thread saves under FSDP, training going on during the second; what the second read,
    whether its copy took new memory, and whether it resumes the shards of its call bit for bit."""
    import ddpkit

    with ddpkit.session(seed=0, verbose=False) as s:
        model, opt = _fsdp(s, width=1024)  # 4 MiB of weights (12 with AdamW's moments), halved per rank
        s.save(root, model=model, optimizer=opt, step=1, background=True)
        s.checkpoints.wait()
        staged = s.checkpoints._background._arena.nbytes()  # the first save's copy
        want = _shards(model, opt)
        before = _rchar()
        path = s.save(root, model=model, optimizer=opt, step=2, background=True)
        with torch.no_grad():  # training goes on while the shards are written
            for p in model.parameters():
                p.add_(1.0)
        s.checkpoints.wait()
        read = _rchar() - before
        reused = s.checkpoints._background._arena.nbytes() == staged > 0
        fresh, fresh_opt = _fsdp(s, width=1024)
        step = s.load(root, model=fresh, optimizer=fresh_opt, step=0)["step"]
        got = _shards(fresh, fresh_opt)
        same = got.keys() == want.keys() and all(got[k].equal(want[k]) for k in want)
        held = sum(v.numel() * v.element_size() for v in want.values())
        size = (Path(path) / "dcp" / f"__{s.rank}_0.distcp").stat().st_size
        return {"step": step, "same": same, "reused": reused, "read": read, "held": held, "size": size,
                "path": str(path)}  # fmt: skip


@pytest.mark.timeout(240)
@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="the reused copy is Linux's (memfd)")
def test_a_thread_save_under_fsdp_reads_nothing_back_and_reuses_the_memory_of_its_copy(pool2, tmp_path: Path) -> None:
    from ddpkit.checkpoint.inspect import report

    ranks = pool2.run(thread_saves, str(tmp_path / "ck"), timeout=180)
    for rank, got in enumerate(ranks):
        assert got["step"] == 2 and got["same"], f"rank {rank}: not the shards of the call"
        assert got["reused"], f"rank {rank}: the second save's copy took new memory"
        # the file holds the shards and DCP's few records around them, not the memory they were copied into
        assert got["held"] < got["size"] < got["held"] + (1 << 20), (rank, got)  # a segment is 64 MiB or more
        # its SHA-256 was taken while it was written: the writer thread never read it back
        assert got["read"] < got["size"] // 4, f"rank {rank}: {got['read']} bytes read during the save: {got}"
    text, ok = report(ranks[0]["path"])
    assert ok, text  # every checksum in the manifest holds
