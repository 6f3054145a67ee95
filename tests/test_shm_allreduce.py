"""The shared-memory all-reduce hook: exact (bitwise equal to gloo with 2 ranks, identical on every rank),
multi-chunk, nothing left in /dev/shm (also after kill -9), and a fallback to gloo across machines."""

from __future__ import annotations

import contextlib
import glob
import io
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import ddpkit
from ddpkit.parallel import shm_allreduce
from ddpkit.parallel.shm_allreduce import PREFIX, ShmAllReduce, clean_stale_segments

# the shared-memory sum (torch's kernels) bitwise gloo's (its own): .ci/run repeats them on the portable kernels
pytestmark = pytest.mark.numerics


def _segments(pid: int | None = None) -> list[str]:
    return glob.glob(f"/dev/shm/{PREFIX}-{pid if pid is not None else ''}*")


def exact_against_gloo(numel: int, chunk_mb: float) -> dict:
    state = ShmAllReduce(chunk_mb=chunk_mb)
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(numel, generator=g) * 10 ** torch.randint(-6, 6, (numel,), generator=g)
    ours = state.all_reduce_mean_(x.clone())
    again = state.all_reduce_mean_(x.clone())  # the other buffer of the double buffer
    theirs = x.clone().div_(dist.get_world_size())
    dist.all_reduce(theirs)
    leftover = _segments(os.getpid())
    active = state.active
    state.close()
    return {"active": active, "ours": ours, "again": again, "theirs": theirs, "leftover": leftover}


@pytest.mark.parametrize(("numel", "chunk_mb"), [(1, 4.0), (10_007, 1 / 256), (300_000, 0.5)])
def test_bitwise_equal_to_gloo_and_across_ranks(numel: int, chunk_mb: float, pool2) -> None:
    r0, r1 = pool2.run(exact_against_gloo, numel, chunk_mb)
    assert r0["active"] and r1["active"]
    assert torch.equal(r0["ours"], r1["ours"]), "ranks disagree"
    assert torch.equal(r0["ours"], r0["again"]), "not deterministic"
    assert torch.equal(r0["ours"], r0["theirs"]), "differs from gloo's a/2 + b/2"
    assert not r0["leftover"] and not r1["leftover"], "segment name not unlinked after attach"


def train_with_hook(hook: str | None, steps: int, fake_machines: bool) -> dict:
    if fake_machines:  # pretend each rank is on its own machine: the hook must fall back to gloo
        real = shm_allreduce._machine_id
        shm_allreduce._machine_id = lambda: f"machine-{dist.get_rank()}"
    # Count the shared-memory all-reduces: shm and gloo give the same bits by design, so only the count
    # tells whether the hook ran at all.
    calls: list[int] = []
    reduce = shm_allreduce.ShmAllReduce.all_reduce_mean_

    def counted(self, tensor: torch.Tensor) -> torch.Tensor:
        calls.append(tensor.numel())
        return reduce(self, tensor)

    shm_allreduce.ShmAllReduce.all_reduce_mean_ = counted  # type: ignore[method-assign]
    try:
        with ddpkit.session(seed=0, verbose=False) as s:
            torch.manual_seed(0)
            net = nn.Sequential(
                nn.Linear(16, 300), nn.ReLU(), nn.Linear(300, 300), nn.ReLU(), nn.Linear(300, 3)
            )
            model = s.model(net, comm_hook=hook, comm_hook_options={"chunk_mb": 0.125} if hook else None)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            for step in range(steps):
                g = torch.Generator().manual_seed(100 * step + s.rank)
                x, y = torch.randn(8, 16, generator=g), torch.randint(0, 3, (8,), generator=g)
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
            return {"params": [p.detach().clone() for p in model.parameters()], "shm_calls": len(calls)}
    finally:
        shm_allreduce.ShmAllReduce.all_reduce_mean_ = reduce  # type: ignore[method-assign]
        if fake_machines:
            shm_allreduce._machine_id = real


def test_ddp_with_shm_hook_trains_the_same_weights_as_gloo(pool2) -> None:
    shm = pool2.run(train_with_hook, "shm", 4, False)
    gloo = pool2.run(train_with_hook, None, 4, False)
    assert all(r["shm_calls"] >= 4 for r in shm), "the shm hook did not run on every step"
    assert all(r["shm_calls"] == 0 for r in gloo)
    for a, b, c in zip(shm[0]["params"], shm[1]["params"], gloo[0]["params"], strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_falls_back_to_gloo_across_machines(pool2) -> None:
    shm = pool2.run(train_with_hook, "shm", 2, True)
    gloo = pool2.run(train_with_hook, None, 2, False)
    assert all(r["shm_calls"] == 0 for r in shm), "shared memory used across (pretended) machines"
    for a, c in zip(shm[0]["params"], gloo[0]["params"], strict=True):
        assert torch.equal(a, c)


def fallback_note() -> str:
    """What rank 0 prints when s.model(..., comm_hook="shm") cannot use shared memory."""
    real = shm_allreduce._machine_id
    shm_allreduce._machine_id = lambda: f"machine-{dist.get_rank()}"
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), ddpkit.session(seed=0) as s:
            s.model(nn.Linear(4, 2), comm_hook="shm")
        return out.getvalue()
    finally:
        shm_allreduce._machine_id = real


def test_fallback_says_why(pool2) -> None:
    assert "comm_hook='shm': ranks on 2 machines: falling back to gloo" in pool2.run(fallback_note)[0]


def test_stale_segments_of_dead_creators_are_removed(tmp_path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"{PREFIX}-{dead.pid}-abc"
    live = tmp_path / f"{PREFIX}-{os.getpid()}-def"
    stale.write_bytes(b"x")
    live.write_bytes(b"x")
    assert clean_stale_segments(str(tmp_path)) == [str(stale)]
    assert live.exists() and not stale.exists()


def _killed_peer(rank: int, port: int, out: mp.SimpleQueue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=30)
    )
    state = ShmAllReduce(chunk_mb=0.0625, timeout=60)
    out.put(("pid", rank, os.getpid()))
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)
    start = time.monotonic()
    try:
        state.all_reduce_mean_(torch.ones(100_000))
        out.put(("result", "no error", 0.0))
    except RuntimeError as err:
        out.put(("result", str(err), time.monotonic() - start))


def test_kill_9_of_a_peer_leaves_no_segment_and_no_hang() -> None:
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [ctx.Process(target=_killed_peer, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    messages = []
    while not out.empty():
        messages.append(out.get())
    for p in procs:
        if p.is_alive():
            p.kill()
    pids = {m[1]: m[2] for m in messages if m[0] == "pid"}
    result = [m for m in messages if m[0] == "result"]
    assert procs[1].exitcode == -signal.SIGKILL
    assert result and "rank 1" in result[0][1] and "died" in result[0][1], result
    # noticed through the dead pid, well before the 60 s timeout (the message says "died", not "timed out")
    assert result[0][2] < 30, f"took {result[0][2]:.1f} s to notice the dead peer"
    assert not _segments(pids[0]), "segment left in /dev/shm"
