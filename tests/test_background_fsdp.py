"""Background saves under FSDP (copied shards, saved by the writer thread with DCP; with background="process"
each rank's DCP file written by its writer process) and the pinned CPU copy, on the shared gloo rank pools,
with a real SIGKILL of a writer process mid-save. (A real SIGKILL of a rank while DCP's thread writes, under
`ddpkit run`, is tests/test_background_save.py's.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ddpkit.checkpoint.background import lower_priority
from ddpkit.checkpoint.write import to_cpu


def _full(model) -> dict[str, torch.Tensor]:
    """Every weight whole (a collective)."""
    import ddpkit

    sd = ddpkit.unwrap(model).state_dict()
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in sd.items()}


def _full_opt(model, opt) -> dict[str, torch.Tensor]:
    """AdamW's moments and step count, whole (a collective), by parameter order."""
    return {
        f"{i}.{k}": (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for i, p in enumerate(model.parameters())
        for k, v in opt.state[p].items()
        if torch.is_tensor(v)
    }


def thread_save_and_load(root: str) -> dict:
    """Rank r: an FSDP background save (background=True: copied shards, DCP on the writer thread) while
    training changes the weights and AdamW's state, then a fresh model and optimizer loaded from the files:
    whole, are they the state of the call?"""
    from torch import nn

    import ddpkit

    with ddpkit.session(seed=0, verbose=False) as s:

        def build():
            torch.manual_seed(0)  # every rank the same weights (s.model seeds each rank on its own after)
            model = s.model(nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)]), strategy="fsdp")
            return model, torch.optim.AdamW(model.parameters(), lr=0.1)

        model, opt = build()
        s.backward(model(torch.randn(4, 256)).square().mean())
        s.step(opt)
        want, want_opt = _full(model), _full_opt(model, opt)
        path = s.save(root, model=model, optimizer=opt, step=1, background=True)
        with torch.no_grad():  # training goes on while DCP's thread writes: weights and optimizer state
            for p in model.parameters():
                p.add_(1.0)
            for state in opt.state.values():
                for v in state.values():
                    if torch.is_tensor(v):
                        v.add_(1.0)
        s.checkpoints.wait()
        fresh, fresh_opt = build()
        step = s.load(root, model=fresh, optimizer=fresh_opt, step=0)["step"]
        got, got_opt = _full(fresh), _full_opt(fresh, fresh_opt)
        same = got.keys() == want.keys() and all(got[k].equal(want[k]) for k in want)
        same_opt = bool(got_opt) and got_opt.keys() == want_opt.keys()
        same_opt = same_opt and all(got_opt[k].equal(want_opt[k]) for k in want_opt)
        return {"step": step, "path": str(path), "same": same, "optimizer_same": same_opt}


# A crash while DCP's thread writes (rank 0 SIGKILLed under a real `ddpkit run`, then the job resumed from
# the checkpoint before) is tests/test_background_save.py's [fsdp-thread] case.
@pytest.mark.timeout(240)
def test_a_background_fsdp_save_loads_the_weights_and_optimizer_state_of_the_call(
    pool2, tmp_path: Path
) -> None:
    ranks = pool2.run(thread_save_and_load, str(tmp_path / "ck"), timeout=180)
    assert (Path(ranks[0]["path"]) / "dcp" / ".metadata").is_file()
    for rank, got in enumerate(ranks):
        assert got["step"] == 1 and got["same"], f"rank {rank}: the weights loaded are not those of the call"
        assert got["optimizer_same"], (
            f"rank {rank}: the optimizer state was not saved as it was after the call"
        )


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
    model = s.model(
        nn.Sequential(nn.Linear(width, width), nn.Linear(width, 64), nn.Linear(64, 8)), strategy="fsdp"
    )
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    s.backward(model(torch.randn(4, width)).square().mean())
    s.step(opt)
    return model, opt


def _shards(model, opt) -> dict[str, torch.Tensor]:
    """This rank's shards of the weights and of AdamW's state, copied (no collective)."""
    local = {f"w.{k}": v.to_local().clone() for k, v in model.state_dict().items()}
    for i, p in enumerate(model.parameters()):
        local |= {
            f"opt.{i}.{k}": (v.to_local() if hasattr(v, "to_local") else v).clone()
            for k, v in opt.state[p].items()
        }
    return local


def _wchar(pid: int) -> int:
    """The bytes process `pid` has written (/proc/PID/io), as a user would read them."""
    return int(dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())["wchar"])


def _process_save(s, root: str) -> dict:
    """Rank r: a process save under FSDP while training changes the state; what the writer process wrote,
    and whether a fresh model and optimizer loaded from it hold the shards of the call, bit for bit."""
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
    return {
        "step": step,
        "same": same,
        "writer": writer,
        "me": os.getpid(),
        "writer_wrote": wrote,
        "file": mine.stat().st_size,
        "path": str(path),
        "weights": {k: v for k, v in want.items() if k.startswith("w.")},
    }


def process_saves(root: str) -> dict:
    """Rank r, one session: `_process_save` into ROOT/save, then `_killed_writer` into ROOT/killed. One
    writer process serves both (it imports torch once, at its first FSDP save, at idle priority)."""
    import ddpkit

    with ddpkit.session(seed=0, verbose=False) as s:
        return {"save": _process_save(s, f"{root}/save"), "killed": _killed_writer(s, f"{root}/killed")}


@pytest.fixture(scope="module")
def process_runs(pool2, tmp_path_factory) -> dict[str, list[dict]]:
    ranks = pool2.run(process_saves, str(tmp_path_factory.mktemp("process")), timeout=200)
    return {part: [got[part] for got in ranks] for part in ("save", "killed")}


# The writer process imports torch at its first FSDP save, at idle priority: slow on a loaded machine.
@pytest.mark.timeout(240)
def test_a_process_save_under_fsdp_is_written_by_the_writer_process_and_resumes_bitwise(process_runs) -> None:
    from ddpkit.checkpoint.inspect import report

    ranks = process_runs["save"]
    for rank, got in enumerate(ranks):
        assert got["step"] == 1 and got["same"], f"rank {rank}: not the shards of the call: {got}"
        assert got["writer"] != got["me"]
        # the rank's DCP file went out through its writer process, not through training's
        assert got["writer_wrote"] >= got["file"] > 0, (
            f"rank {rank}: its writer process did not write its shards"
        )
    text, ok = report(ranks[0]["path"])
    assert ok, text  # every checksum in the manifest holds: what `ddpkit checkpoint inspect` checks
    # and DCP reshards it like any FSDP checkpoint: one process (here) loads the whole weights, which are the
    # two ranks' dim-0 shards at the call, joined
    from torch import nn

    import ddpkit

    with ddpkit.session(seed=0, verbose=False) as s:
        one = s.model(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 8)), strategy="fsdp")
        assert s.load(str(Path(ranks[0]["path"]).parent), model=one, step=0)["step"] == 1
    for k, v in one.state_dict().items():
        joined = torch.cat([ranks[0]["weights"][f"w.{k}"], ranks[1]["weights"][f"w.{k}"]])
        assert v.equal(joined), f"{k}: one process did not load the two ranks' shards"


def _killed_writer(s, root: str) -> dict:
    """Rank r: a checkpoint, then a process save whose writer process on rank 1 is killed mid-save; what
    each rank saw, what the folder holds, and whether the next save (a new writer) commits."""
    import signal

    from ddpkit.checkpoint.checkpoints import latest

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
    return {
        "error": error,
        "after": after,
        "newest": newest,
        "step": step,
        "next": Path(path).name,
        "new_writer": s.checkpoints._process.process.pid != writer,
    }


@pytest.mark.timeout(240)
def test_a_killed_fsdp_writer_process_fails_the_save_on_every_rank_and_loses_no_checkpoint(
    process_runs,
) -> None:
    ranks = process_runs["killed"]
    assert "killed by signal 9" in ranks[1]["error"], ranks[1]["error"]
    assert ranks[0]["error"], (
        "rank 0 committed (or did not report) a save that rank 1's writer never finished"
    )
    for got in ranks:
        assert got["after"] == ["ckpt-000001"] and got["newest"] == "ckpt-000001", (
            got
        )  # partial files removed
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
        return {
            "step": step,
            "same": same,
            "reused": reused,
            "read": read,
            "held": held,
            "size": size,
            "path": str(path),
        }


@pytest.mark.timeout(240)
@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="the reused copy is Linux's (memfd)")
def test_a_thread_save_under_fsdp_reads_nothing_back_and_reuses_the_memory_of_its_copy(
    pool2, tmp_path: Path
) -> None:
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
