"""The keepers between hosts and the snapshot cadence (`ddpkit.cluster.keeper`, `ddpkit.checkpoint.memory`,
`ddpkit.checkpoint.memory_hosts`, `ddpkit.checkpoint.memory_cadence`), on loopback in this process and in
the 2-rank pool: a keeper's TCP serves only its job's token; the buddy copy is at most one snapshot
behind (a commit beyond it waits, then says it goes on); a recovery that cannot come from memory names
why in one line (a lost host whose copy was behind, an elastic growth, a sharded state at another world
size); an elastic shrink of a DDP run recovers from memory as from disk; `memory="auto"` takes N > 1 for a
heavy state and a short step, N = 1 for a light one, and says N. The recovery across two hosts under
`ddpkit run` is in tests/test_memory_recovery_hosts.py.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from ddpkit.checkpoint.memory import MemoryRecovery, MemorySnapshots
from ddpkit.checkpoint.memory_cadence import Cadence, every_for
from ddpkit.checkpoint.memory_hosts import ring, why_disk
from ddpkit.cluster.keeper import Keeper, KeeperClient, KeeperRefused, fetch
from ddpkit.names import KEEPER_ENV


class _Single:
    shards_state = False

    def owns(self, model: nn.Module) -> bool:
        return False


def _snapshot(snaps: MemorySnapshots, steps: range, model: nn.Module | None = None) -> None:
    model = model or nn.Linear(4, 3)
    for step in steps:
        snaps.save(step, _Single(), {"model": model, "step": step})


def _steps_held(address: str, key: str, token: str) -> list[int]:
    return [int.from_bytes(blob[8:16], "little", signed=True) for blob in fetch(address, key, token)]


def _read_all(conn: socket.socket) -> bytes:
    got = b""
    while chunk := conn.recv(1 << 16):
        got += chunk
    return got


def test_a_keepers_tcp_serves_only_connections_that_bring_its_job_token() -> None:
    keeper = Keeper.start(tcp="127.0.0.1:0")
    snaps = MemorySnapshots.attach(keeper.name, 0, 1)
    try:
        assert keeper.tcp is not None and len(keeper.token) == 32
        _snapshot(snaps, range(1, 3))
        assert _steps_held(keeper.tcp, "w1/r0", keeper.token) == [2, 1]  # the job's token: served
        with pytest.raises(KeeperRefused, match="wrong or missing job token"):
            fetch(keeper.tcp, "w1/r0", "0" * 32)
        host, _, port = keeper.tcp.rpartition(":")
        with socket.create_connection((host, int(port)), timeout=10) as conn:  # a fetch behind a wrong token
            conn.sendall(b'{"token": "guess"}\n{"op": "fetch", "key": "w1/r0"}\n')
            said = _read_all(conn)
        assert said.count(b"\n") == 1 and list(json.loads(said)) == [
            "refused"
        ]  # one line, no bytes of a slot
        with socket.create_connection((host, int(port)), timeout=10) as conn:  # a push without any token
            blob = b"x" * 128
            conn.sendall(
                json.dumps({"op": "push", "key": "w1/r5", "n": len(blob), "seq": 1}).encode() + b"\n"
            )
            conn.sendall(blob + b'{"ok": true}\n')
            assert b"refused" in _read_all(conn)
        keys = KeeperClient.connect(keeper.name).keys()
        assert keys["received"] == 0 and keys["refused"] == 3 and "w1/r5" not in keys["keys"]
    finally:
        snaps.close()
        keeper.stop()


def _stalled_buddy() -> tuple[str, threading.Event]:
    """A keeper's stand-in that admits any token and reads pushes but never acknowledges one."""
    srv = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def serve() -> None:
        conn, _ = srv.accept()
        conn.recv(1 << 10)
        conn.sendall(b'{"ok": true}\n')
        while not done.is_set() and conn.recv(1 << 20):
            pass
        conn.close()
        srv.close()

    threading.Thread(target=serve, daemon=True).start()
    return f"127.0.0.1:{srv.getsockname()[1]}", done


def test_the_buddy_copy_is_at_most_one_snapshot_behind_and_a_stalled_buddy_is_said_once(capfd) -> None:
    home, buddy = Keeper.start(), Keeper.start(tcp="127.0.0.1:0")
    snaps = MemorySnapshots.attach(home.name, 0, 1)
    try:
        assert buddy.tcp is not None
        snaps.wire(buddy.tcp, buddy.token)
        model = nn.Linear(256, 256)
        for step in range(1, 7):  # after each commit the buddy holds at least the snapshot before
            _snapshot(snaps, range(step, step + 1), model)
            assert max(_steps_held(buddy.tcp, "w1/r0", buddy.token), default=0) >= step - 1, step
        assert snaps.waited_s < 5 and not snaps.buddy_behind
        snaps.close()
        address, done = _stalled_buddy()
        snaps = MemorySnapshots.attach(home.name, 0, 1)
        snaps.wire(address, "any")
        snaps.lag_wait = 1.0
        timed = []
        for step in range(7, 10):
            start = time.monotonic()
            _snapshot(snaps, range(step, step + 1), model)
            timed.append(time.monotonic() - start)
        done.set()
        err = capfd.readouterr().err
        assert timed[0] < 0.9 and timed[1] >= 1.0 and timed[2] < 0.9, (
            timed
        )  # 7: in flight; 8 waits; 9 goes on
        assert err.count("the buddy host's keeper holds no copy") == 1, err
        assert "steps [7, 8] after 1 s (2 behind, 1 allowed)" in err and snaps.buddy_behind
    finally:
        snaps.close()
        home.stop()
        buddy.stop()


def test_the_hosts_form_a_ring_and_a_recovery_from_disk_says_why() -> None:
    a, b, c = ("10.0.0.1:1", "t1"), ("10.0.0.2:2", "t2"), ("10.0.0.3:3", "t3")
    assert ring([a, a, b, b, c, c], b) == [c, a]  # the next host in node order first: its buddy
    assert ring([a, a], a) == [] and ring([("", ""), ("", "")], ("", "")) == []  # one host: no buddy
    rows = [[7, 6, -1, 0, -1], [5, 4, -1, 1, -1]]  # rank 1 on a replacement host, its copy behind
    assert why_disk(rows, 2) == (
        "ddpkit: no step is held in memory by every rank (rank 0: 7, 6; rank 1: 5, 4 (from another host)): "
        "the copy of a lost host's snapshots on its buddy was behind the others, so recovery is from disk"
    )
    assert why_disk([[-1, -1, -1, 0, -1]] * 2, 2) == ""  # a fresh start says nothing


def test_every_for_keeps_a_snapshot_under_five_percent_of_the_steps_it_covers() -> None:
    assert every_for(0.001, 0.2) == 1 and every_for(0.087, 1.09) == 2 and every_for(0.087, 0.22) == 8
    for copy, step in [(0.087, 0.22), (0.5, 0.01), (0.01, 0.2)]:
        n = every_for(copy, step)
        assert copy / (n * step) <= 0.05 + 1e-12 and (n == 1 or copy / ((n - 1) * step) > 0.05)


def _auto(model: nn.Module, step_s: float) -> tuple[int | None, list[str]]:
    """memory="auto" over 6 steps of `step_s` seconds with `model` as the state; (N, what it said)."""
    said: list[str] = []
    recovery = MemoryRecovery(MemorySnapshots(None, "w1/r0"), Cadence.of("auto", say=said.append))
    for step in range(1, 7):
        time.sleep(step_s)
        recovery.at_boundary(step, _Single(), {"model": model})
    recovery.close(drop=False)
    return recovery.cadence.every, said


def test_memory_auto_takes_n_above_one_for_a_heavy_state_and_one_for_a_light_one() -> None:
    heavy, said = _auto(nn.Linear(4096, 4096), 0.005)  # 67 MB against a 5 ms step
    assert heavy is not None and heavy > 1, said
    assert said[0].startswith(
        f'ddpkit: memory="auto": a snapshot every {heavy} optimizer steps (a snapshot of 67'
    )
    light, said = _auto(nn.Linear(4, 3), 0.3)  # 60 bytes against a 300 ms step
    assert light == 1 and said[0].startswith('ddpkit: memory="auto": a snapshot every 1 optimizer step ('), (
        said
    )


def _load_with_memory(root: str, keeper: str) -> tuple[str, Any]:
    """In the pool: a keeper holding a smaller world size's snapshots, then s.load(..., memory="auto")
    and a few short steps; what rank 0 printed, and the N chosen."""
    import ddpkit

    os.environ[KEEPER_ENV] = keeper
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), ddpkit.session(seed=0) as s:
            model = s.model(nn.Linear(4, 3))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            data = TensorDataset(torch.randn(48, 4), torch.randint(0, 3, (48,)))
            loader = s.loader(data, batch_size=8)
            step = s.load(root, model=model, optimizer=opt, loader=loader, step=0, memory="auto")["step"]
            for x, y in loader:
                s.backward(nn.functional.cross_entropy(model(x), y))
                s.step(opt)
                step += 1
                time.sleep(0.4)  # a step of 0.4 s: a snapshot of a few ms is far under 5%
            every = s.checkpoints._memory.cadence.every
    finally:
        del os.environ[KEEPER_ENV]
    return out.getvalue(), every


def test_an_elastic_resize_recovers_from_disk_and_says_why_and_auto_says_its_n(pool2, tmp_path: Path) -> None:
    keeper = Keeper.start()
    try:
        old = MemorySnapshots.attach(keeper.name, 0, 1)  # what a 1-rank run left in this host's keeper
        _snapshot(old, range(1, 3))
        old.close()
        results = pool2.run(_load_with_memory, str(tmp_path / "ckpt"), keeper.name, timeout=120)
    finally:
        keeper.stop()
    said, every = results[0]
    assert (  # a growth: rank 1 has no snapshot of its own (a shrink is restored: the test below)
        "ddpkit: the memory snapshots on this job's hosts are of world size 1 and this run has 2 ranks (an "
        "elastic resize): a snapshot restores only at the world size that took it" in said
    ), said
    assert (
        every == 1 and results[1][1] == 1 and 'memory="auto": a snapshot every 1 optimizer step (' in said
    ), said


def test_ddpkit_run_across_hosts_gives_its_ranks_the_keepers_address_and_token(monkeypatch) -> None:
    from ddpkit.cluster.keeper import ADDRESS_ENV, TOKEN_ENV
    from ddpkit.cluster.launch import LaunchConfig, start_keeper

    for name in (KEEPER_ENV, ADDRESS_ENV, TOKEN_ENV):
        monkeypatch.delenv(name, raising=False)
    script = str(Path(__file__))
    across = LaunchConfig(target=script, nnodes=2, rdzv_endpoint="127.0.0.1:29400", local_addr="127.0.0.1")
    keeper = start_keeper(across)
    try:
        address, token = os.environ[ADDRESS_ENV], os.environ[TOKEN_ENV]
        assert address.startswith("127.0.0.1:") and token == keeper.token and len(token) == 32
        assert fetch(address, "w2/r0", token) == []  # reachable there, and its token admitted
    finally:
        keeper.stop()
    single = start_keeper(LaunchConfig(target=script))  # one host: no TCP, no address from the last launch
    try:
        assert single.tcp is None and ADDRESS_ENV not in os.environ and os.environ[TOKEN_ENV] != token
    finally:
        single.stop()


def _shrink_run(keeper: str | None, root: str, disk: str | None, stop_at: int | None) -> tuple[str, dict]:
    """In a pool: a DDP run of 12 steps (dropout, AdamW, a shuffled loader), `s.load(root, ...)` first
    (`memory=1` with `keeper`), `s.save(disk)` at step 4, stopped after step `stop_at`; what rank 0
    printed and this rank's final state."""
    import torch.nn.functional as F

    import ddpkit

    if keeper:
        os.environ[KEEPER_ENV] = keeper
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), ddpkit.session(seed=0) as s:
            torch.manual_seed(0)
            model = s.model(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3)))
            opt = torch.optim.AdamW(model.parameters(), lr=0.01)
            g = torch.Generator().manual_seed(7)
            data = TensorDataset(torch.randn(96, 8, generator=g), torch.randint(0, 3, (96,), generator=g))
            loader = s.loader(data, batch_size=16, shuffle=True)
            state = {"model": model, "optimizer": opt, "loader": loader}
            step = s.load(root, **state, step=0, memory=1 if keeper else False)["step"]
            for _ in range(loader.epoch, 2):
                for x, y in loader:
                    s.backward(F.cross_entropy(model(x), y))
                    s.step(opt)
                    step += 1
                    if disk and step == 4:
                        s.save(disk, **state, step=step)
                    if step == stop_at:
                        break
                if step == stop_at:
                    break
            weights = {k: v.clone() for k, v in ddpkit.unwrap(model).state_dict().items()}
            moments = {
                f"{i}/{k}": v.clone() for i, st in enumerate(opt.state.values()) for k, v in st.items()
            }
    finally:
        os.environ.pop(KEEPER_ENV, None)
    return out.getvalue(), {"weights": weights, "opt": moments, "rng": torch.get_rng_state(), "step": step}


def test_an_elastic_shrink_of_a_ddp_run_recovers_from_memory_as_from_disk(
    pool4, pool2, tmp_path: Path
) -> None:
    # 4 ranks snapshot every step and save to disk at step 4, then stop after step 5 (memory holds 3 and
    # 4). At 2 ranks, new rank r takes old rank r's snapshot of step 4 (DDP: the whole model and
    # optimizer) and ends bitwise like the same 2 ranks resumed from the disk checkpoint of step 4.
    keeper = Keeper.start()
    try:
        pool4.run(_shrink_run, keeper.name, str(tmp_path / "mem4"), str(tmp_path / "disk"), 5, timeout=120)
        from_memory = pool2.run(_shrink_run, keeper.name, str(tmp_path / "mem2"), None, None, timeout=120)
        assert KeeperClient.connect(keeper.name).keys()["keys"].keys() == {"w4/r2", "w4/r3", "w2/r0", "w2/r1"}
    finally:
        keeper.stop()
    from_disk = pool2.run(_shrink_run, None, str(tmp_path / "disk"), None, None, timeout=120)
    said = from_memory[0][0]
    assert "ddpkit: resumed from memory at step 4 (every rank's snapshot of it); world size 4 -> 2" in said, (
        said
    )
    for rank in range(2):
        got, want = from_memory[rank][1], from_disk[rank][1]
        assert got["step"] == want["step"] == 12 and torch.equal(got["rng"], want["rng"])
        for part in ("weights", "opt"):
            assert got[part].keys() == want[part].keys()
            assert all(torch.equal(got[part][k], want[part][k]) for k in got[part]), (rank, part)


def test_a_sharded_state_at_another_world_size_is_refused_by_name() -> None:
    from ddpkit.checkpoint.memory_hosts import resize_refusal

    class Sharded:
        shards_state = True

    assert resize_refusal(Sharded(), {"model": nn.Linear(2, 2)}) == (
        "under FSDP and HSDP each rank's snapshot holds its shards at that world size"
    )
    assert resize_refusal(_Single(), {"model": nn.Linear(2, 2), "g": torch.Generator()}) == ""


def _slow_acks(target: str, delay: float) -> tuple[str, threading.Event]:
    """A relay to the keeper at `target` that holds each of its acknowledgements ("stored") `delay`
    seconds: a buddy host that stalls (the pushes reach it at once; it answers late)."""
    srv = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()
    host, _, port = target.rpartition(":")

    def relay(conn: socket.socket) -> None:
        with conn, socket.create_connection((host, int(port))) as up, up.makefile("rb") as answers:
            threading.Thread(target=lambda: _pipe(conn, up), daemon=True).start()
            while not done.is_set() and (line := answers.readline()):
                if b"stored" in line:
                    time.sleep(delay)
                conn.sendall(line)

    def serve() -> None:
        while not done.is_set():
            conn, _ = srv.accept()
            threading.Thread(target=relay, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return f"127.0.0.1:{srv.getsockname()[1]}", done


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while chunk := src.recv(1 << 16):
            dst.sendall(chunk)


def _train_beside_a_stalled_buddy(strict: bool) -> tuple[list[tuple[int, int, float]], list[str]]:
    """Four steps of 0.5 s with a snapshot each through `MemoryRecovery` (as `s.load(..., memory=1,
    buddy=...)` arms it), the buddy's acknowledgements 0.35 s late; for each forward after a snapshot:
    (the step snapshotted, the newest step the buddy had acknowledged as the forward began, the wait
    before it)."""
    home, buddy = Keeper.start(), Keeper.start(tcp="127.0.0.1:0")
    assert buddy.tcp is not None
    address, done = _slow_acks(buddy.tcp, 0.35)
    snaps = MemorySnapshots.attach(home.name, 0, 1)
    snaps.strict = strict
    snaps.wire(address, buddy.token)
    said: list[str] = []
    recovery, model = MemoryRecovery(snaps, Cadence.of(1), say=said.append), nn.Linear(64, 64)
    seen: list[tuple[int, int, float]] = []
    asks = KeeperClient.connect(home.name)
    model.register_forward_pre_hook(  # after the product's own pre-hook (it is first): what the forward sees
        lambda *_: seen.append((step, asks.acked("w1/r0"), time.monotonic() - at))
    )
    try:
        for step in range(1, 5):
            recovery.at_boundary(step, _Single(), {"model": model})
            at = time.monotonic()
            model(torch.randn(2, 64)).sum().backward()
            time.sleep(0.5)
        recovery.close(drop=True)
    finally:
        asks.close()
        done.set()
        home.stop()
        buddy.stop()
    return seen, said


def test_before_next_step_the_buddy_holds_each_snapshot_before_the_next_forward_and_behind_does_not_wait(
    tmp_path: Path,
) -> None:
    seen, said = _train_beside_a_stalled_buddy(strict=True)
    for step, acked, waited in seen:  # the forward of step k+1 began with step k held by the buddy
        assert acked == step and waited >= 0.25, seen
    assert len(said) == 1 and "the buddy copy (buddy='before-next-step') took 4 snapshots" in said[0], said
    assert "MB sent per snapshot; training waited 1." in said[0], said  # 4 x 0.35 s
    seen, said = _train_beside_a_stalled_buddy(strict=False)
    assert all(acked < step and waited < 0.1 for step, acked, waited in seen), seen  # copied behind
    assert "(buddy='behind') took 4 snapshots" in said[0] and "training waited 0.0" in said[0], said
    import ddpkit

    with (
        ddpkit.session(seed=0) as s,
        pytest.raises(Exception, match="buddy='strict' is not a buddy copy mode"),
    ):
        s.load(str(tmp_path / "ckpt"), model=s.model(nn.Linear(2, 2)), memory=1, buddy="strict")
