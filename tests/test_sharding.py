"""Sharded optimizer steps (ddpkit.step.sharding): the same weights bit for bit, state only where it is owned,
full state in checkpoints, the broadcast path across machines, and a clear error with s.join."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ddpkit
from ddpkit.errors import DdpkitError
from ddpkit.parallel import shm_allreduce
from ddpkit.parallel.shm_allreduce import ShmAllReduce
from ddpkit.step import sharding

pytestmark = pytest.mark.numerics  # .ci/run runs these again under ATEN_CPU_CAPABILITY=default


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 3))


def _train(s, model, opt, steps: int) -> None:
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + s.rank)
        x, y = torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g)
        s.backward(nn.functional.cross_entropy(model(x), y))
        s.step(opt, max_norm=1.0)


def train(shard, steps: int = 5, fake_machines: bool = False, save_to: str | None = None) -> dict:
    real = shm_allreduce._machine_id
    if fake_machines:  # each rank on "its own machine": no shared memory, broadcasts instead
        shm_allreduce._machine_id = lambda: f"machine-{dist.get_rank()}"
    try:
        with ddpkit.session(seed=0, verbose=False, shard_optimizer=shard) as s:
            model = s.model(_net())
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
            _train(s, model, opt, steps)
            sharder = s.stepper.sharded_step(opt)
            if save_to:
                s.save(save_to, model=model, optimizer=opt)
            return {
                "params": [p.detach().clone() for p in model.parameters()],
                "state_of": [p in opt.state for p in model.parameters()],
                "sharded": sharder is not None,
                "via_shm": sharder is not None and sharder.shm is not None,
                "state": opt.state_dict(),
            }
    finally:
        shm_allreduce._machine_id = real


def _error_of(call) -> str:
    """The message of the ddpkit error `call()` raises, or "no error"."""
    try:
        call()
    except DdpkitError as err:
        return str(err)
    return "no error"


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_sharded_steps_give_the_unsharded_weights_bitwise(pool2) -> None:
    sharded = pool2.run(train, True)
    full = pool2.run(train, False)
    assert sharded[0]["sharded"] and sharded[0]["via_shm"] and not full[0]["sharded"]
    assert _same(sharded[0]["params"], sharded[1]["params"]), "replicas differ"
    assert _same(sharded[0]["params"], full[0]["params"]), "sharding changed the weights"
    # optimizer state only on the owner: every parameter on exactly one rank
    owners = [a + b for a, b in zip(sharded[0]["state_of"], sharded[1]["state_of"], strict=True)]
    assert owners == [1] * len(owners)
    assert all(full[0]["state_of"])


def test_broadcast_path_across_machines_is_bitwise_too(pool2) -> None:
    sharded = pool2.run(train, True, 5, True)
    full = pool2.run(train, False)
    assert sharded[0]["sharded"] and not sharded[0]["via_shm"]
    assert _same(sharded[1]["params"], full[1]["params"])
    auto = pool2.run(train, "auto", 2, True)  # "auto" does not shard without shared memory
    assert not auto[0]["sharded"]


def test_checkpoint_holds_the_full_optimizer_state(pool2, tmp_path) -> None:
    pool2.run(train, True, 4, False, str(tmp_path))
    full = pool2.run(train, False, 4)
    loaded = pool2.run(load_unsharded, str(tmp_path))
    want = full[0]["state"]["state"]
    for got in loaded:
        assert sorted(got["state"]["state"]) == sorted(want)
        for k, st in want.items():
            for key, value in st.items():
                assert torch.equal(torch.as_tensor(got["state"]["state"][k][key]), torch.as_tensor(value)), (
                    k,
                    key,
                )


def load_unsharded(path: str) -> dict:
    with ddpkit.session(seed=0, verbose=False, shard_optimizer=False) as s:
        model = s.model(_net())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        s.load(path, model=model, optimizer=opt)
        return {"state": opt.state_dict()}


def join_after_sharded_steps() -> str:
    with ddpkit.session(seed=0, verbose=False, shard_optimizer=True) as s:
        model = s.model(_net())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        _train(s, model, opt, 1)

        def in_join() -> None:
            with s.join(model):
                _train(s, model, opt, 1)

        return _error_of(in_join)


def test_join_after_sharded_steps_is_a_clear_error(pool2) -> None:
    for message in pool2.run(join_after_sharded_steps):
        assert "s.join began after sharded optimizer steps" in message and "shard_optimizer=False" in message


def gather_streams(sizes: list[list[int]], chunk_mb: float) -> list[list[torch.Tensor]]:
    state = ShmAllReduce(chunk_mb=chunk_mb)
    rank = dist.get_rank()
    owned = [
        [torch.full((n,), float(r * 1000 + i)) if r == rank else torch.zeros(n) for i, n in enumerate(ns)]
        for r, ns in enumerate(sizes)
    ]
    state.all_gather_(owned)
    state.close()
    return owned


def test_shm_all_gather_moves_uneven_streams_over_many_chunks(pool2) -> None:
    sizes = [[3000, 1, 5000], [7]]  # rank 0 streams 32 KB, rank 1 28 bytes; 4 KB chunks
    for got in pool2.run(gather_streams, sizes, 1 / 256):
        for r, ns in enumerate(sizes):
            for i, n in enumerate(ns):
                assert torch.equal(got[r][i], torch.full((n,), float(r * 1000 + i)))


@pytest.mark.parametrize(("sizes", "world"), [([5, 1, 9, 3, 3], 2), ([4, 4, 4], 3), ([1], 2)])
def test_partition_balances_and_is_deterministic(sizes: list[int], world: int) -> None:
    owner = sharding.partition(sizes, world)
    assert owner == sharding.partition(sizes, world)
    loads = [sum(n for n, o in zip(sizes, owner, strict=True) if o == r) for r in range(world)]
    assert max(loads) - min(loads) <= max(sizes)


def test_bad_shard_option_is_a_clear_error() -> None:
    with pytest.raises(DdpkitError, match="shard_optimizer='yes'"):
        ddpkit.Session(_plan(), shard_optimizer="yes")


def _plan():
    from ddpkit.cluster import topology

    return topology.resolve({}, topology.Hardware(gpus=0, cpu_cores=2))


def printed_at_first_step(shard) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), ddpkit.session(seed=0, shard_optimizer=shard) as s:
        model = s.model(_net())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _train(s, model, opt, 2)
    return out.getvalue()


def test_rank_0_says_once_that_the_step_is_sharded(pool2) -> None:
    text = pool2.run(printed_at_first_step, True)[0]
    assert text.count("optimizer step sharded over 2 ranks (AdamW") == 1 and "shared memory" in text


def auto_decision(width: int, optimizer: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), ddpkit.session(seed=0) as s:
        model = s.model(nn.Linear(width, width))
        opt = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[optimizer](model.parameters(), lr=1e-3)
        s.backward(model(torch.randn(2, width)).square().mean())
        s.step(opt)
        return {"sharded": s.stepper.sharded_step(opt) is not None, "printed": out.getvalue()}


def test_auto_leaves_a_small_model_whole_and_says_nothing(pool2) -> None:
    for r in pool2.run(auto_decision, 16, "adamw"):
        assert not r["sharded"] and "sharded" not in r["printed"]


def test_auto_shards_a_model_past_the_break_even(pool2) -> None:
    width = 2048  # 4.2M parameters: AdamW sharded 0.73x the plain step (benchmarks/shard_breakeven.py)
    assert width * (width + 1) >= sharding.AUTO_MIN_PARAMETERS
    for r in pool2.run(auto_decision, width, "adamw"):
        assert r["sharded"]
    assert "optimizer step sharded over 2 ranks" in pool2.run(auto_decision, width, "adamw")[0]["printed"]
    assert not any(r["sharded"] for r in pool2.run(auto_decision, width, "sgd"))  # SGD: not below 17M


def param_group_added_after_sharded_steps() -> str:
    with ddpkit.session(seed=0, verbose=False, shard_optimizer=True) as s:
        model = s.model(_net())
        opt = torch.optim.SGD(list(model.parameters())[:-1], lr=0.1)
        _train(s, model, opt, 1)
        opt.add_param_group({"params": [list(model.parameters())[-1]]})
        return _error_of(lambda: _train(s, model, opt, 1))


def test_parameters_added_after_sharded_steps_is_a_clear_error(pool2) -> None:
    for message in pool2.run(param_group_added_after_sharded_steps):
        assert "parameters changed after sharded steps began" in message
