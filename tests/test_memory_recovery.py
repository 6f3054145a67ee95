"""Memory snapshots (`ddpkit.checkpoint.memory`) and the keeper that holds them (`ddpkit.cluster.keeper`).

The slot protocol in one process (a forked child killed in the middle of a save, a torn tree, two
steps kept apart), the agreement as a pure function and over a real gloo group in the 2-rank pool,
the keeper's lifetime (the slots outlive the process that wrote them; the keeper ends with its
parent), and the refusal of a snapshot of other objects. The recoveries under `ddpkit run` are in
tests/test_memory_recovery_faults.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ddpkit.checkpoint.memory import MemorySnapshots, SnapshotMismatch, choose
from ddpkit.cluster.keeper import Keeper, KeeperClient


def _single() -> Any:
    class Single:
        shards_state = False

        def owns(self, model: nn.Module) -> bool:
            return False

    return Single()


def _objects(seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return {"model": model, "optimizer": opt, "scheduler": sched}


def _train(state: dict[str, Any], snaps: MemorySnapshots, steps: range) -> dict[int, dict[str, torch.Tensor]]:
    """Steps with a snapshot after each; the weights at each step."""
    seen = {}
    for step in steps:
        state["model"](torch.randn(5, 4)).sum().backward()
        state["optimizer"].step()
        state["scheduler"].step()
        snaps.save(step, _single(), {**state, "step": step})
        seen[step] = {k: v.clone() for k, v in state["model"].state_dict().items()}
    return seen


def _equal(model: nn.Module, weights: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


def test_the_agreement_takes_the_newest_step_every_rank_holds() -> None:
    assert choose([{5, 6}, {6, 7}, {6}]) == 6  # a rank killed in snapshot 7 holds 6 only
    assert choose([{5, 7}, {5, 6}]) == 5  # every N steps: the newest common one, not the min of the newest
    assert choose([{5, 6}, {7, 8}]) is None  # no step every rank holds: disk
    assert choose([set(), {3}]) is None and choose([]) is None


def test_two_steps_are_never_mixed_and_a_restore_takes_the_step_asked() -> None:
    state, snaps = _objects(), MemorySnapshots(None, "w1/r0")
    seen = _train(state, snaps, range(1, 4))
    assert sorted(snaps.held()) == [2, 3]  # two slots: the newest two steps, each whole
    fresh = _objects(seed=1)
    values = snaps.restore(2, _single(), {**fresh, "step": 0})
    assert values["step"] == 2 and _equal(fresh["model"], seen[2]) and not _equal(fresh["model"], seen[3])
    assert fresh["scheduler"].last_epoch == 2 and fresh["optimizer"].state_dict()["state"][0]["step"] == 2
    # the restored optimizer state is its own (cloned out of the slot): the next save must not change it
    moment = fresh["optimizer"].state[fresh["model"][0].weight]["exp_avg"].clone()
    _train(state, snaps, range(4, 6))
    assert torch.equal(fresh["optimizer"].state[fresh["model"][0].weight]["exp_avg"], moment)
    snaps.close()


def test_a_fault_in_the_middle_of_a_snapshot_leaves_the_previous_one_whole() -> None:
    state, snaps = _objects(), MemorySnapshots(None, "w1/r0")
    seen = _train(state, snaps, range(1, 3))
    child = os.fork()
    if child == 0:  # the rank that dies: half of snapshot 3 copied over the slot of step 1, then SIGKILL
        write, count = snaps.write_tensor, [0]

        def writing(slot: Any, offset: int, t: torch.Tensor) -> None:
            count[0] += 1
            if count[0] == 6:
                os.kill(os.getpid(), signal.SIGKILL)
            write(slot, offset, t)

        snaps.write_tensor = writing  # type: ignore[method-assign]
        _train(state, snaps, range(3, 4))
        os._exit(0)
    _, status = os.waitpid(child, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert sorted(snaps.held()) == [2]  # the torn slot (it held step 1) holds nothing now
    assert [s.header()[0] for s in snaps.slots].count(-1) == 1
    fresh = _objects(seed=1)
    assert snaps.restore(2, _single(), {**fresh, "step": 0})["step"] == 2 and _equal(fresh["model"], seen[2])
    snaps.close()


def test_a_torn_tree_is_no_snapshot_and_another_model_is_refused() -> None:
    state, snaps = _objects(), MemorySnapshots(None, "w1/r0")
    _train(state, snaps, range(1, 3))
    slot = snaps.slots[snaps.held()[1]]
    _, _, off, n, _ = slot.header()
    slot.map[off + n // 2] ^= 0x20  # one flipped bit in the tree of step 1
    assert sorted(snaps.held()) == [2]
    other = {"model": nn.Linear(4, 3), "step": 0}
    with pytest.raises(
        SnapshotMismatch, match=r"/modules/model/0.weight: \['float32', \[8, 4\]\] saved, None"
    ):
        snaps.restore(2, _single(), other)
    snaps.close()


def test_the_keepers_slots_outlive_the_rank_that_wrote_them() -> None:
    keeper = Keeper.start()
    try:
        child = os.fork()
        if child == 0:  # a rank: attaches, snapshots two steps, is SIGKILLed
            snaps = MemorySnapshots.attach(keeper.name, 0, 1)
            _train(_objects(), snaps, range(1, 3))
            os.kill(os.getpid(), signal.SIGKILL)
        os.waitpid(child, 0)
        snaps = MemorySnapshots.attach(keeper.name, 0, 1)  # the restarted rank
        assert sorted(snaps.held()) == [1, 2]
        assert MemorySnapshots.attach(keeper.name, 1, 2).slots == []  # another rank's key: nothing
        snaps.drop()
        snaps.close()
        assert KeeperClient.connect(keeper.name).keys()["keys"] == {}
    finally:
        keeper.stop()


START_AND_WAIT = """
import sys, time
from ddpkit.cluster.keeper import Keeper
keeper = Keeper.start()
print(keeper.process.pid, flush=True)
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_the_keeper_ends_with_the_launcher_whatever_kills_it() -> None:
    launcher = subprocess.Popen([sys.executable, "-c", START_AND_WAIT], stdout=subprocess.PIPE, text=True)
    assert launcher.stdout is not None
    pid = int(launcher.stdout.readline())
    assert _alive(pid)
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid), "the keeper outlived the launcher that started it"


def _agree_over_gloo(held: list[list[int]]) -> int | None:
    import torch.distributed as dist

    snaps = MemorySnapshots(None, f"w2/r{dist.get_rank()}")
    state = _objects()
    _train(state, snaps, range(1, 1 + max(held[dist.get_rank()])))
    for slot in snaps.slots:  # keep only the steps this rank is said to hold
        if slot.complete_step() not in held[dist.get_rank()]:
            slot.begin(0)
    target = snaps.agree(distributed=True, device="cpu")
    snaps.close()
    return target


def test_the_ranks_agree_on_the_newest_step_all_hold_over_a_real_group(pool2) -> None:
    assert pool2.run(_agree_over_gloo, [[2, 3], [2]]) == [2, 2]
    assert pool2.run(_agree_over_gloo, [[3, 4], [1, 2]]) == [None, None]


def test_training_goes_on_when_the_keeper_is_gone() -> None:
    keeper = Keeper.start()
    snaps = MemorySnapshots.attach(keeper.name, 0, 1)
    state = _objects()
    _train(state, snaps, range(1, 2))
    keeper.stop()  # killed, or the launch ending while a rank still trains
    _train(state, snaps, range(2, 4))
    assert snaps.lost_keeper and sorted(snaps.held()) == [2, 3]
    snaps.close()
