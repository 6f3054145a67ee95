"""The extension points, used from outside ddpkit as a user or a contributor would: a strategy registered
by name (the next strategy is one module with a builder plus one `register` call, touching neither the
step nor the session), a strategy instance, a tracker of one's own receiving `s.log`, a launcher
detector of one's own; and the start-up line that names the strategy and its shape first."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Mapping

import pytest
import torch
from recording import Recorder
from torch import nn

import ddpkit
from ddpkit import strategy as strategies
from ddpkit.cluster.environments import RankEnv
from ddpkit.parallel.precision import PrecisionPlan
from ddpkit.parallel.shape import Shape
from ddpkit.strategy import DDP, Single, Strategy
from ddpkit.strategy.registry import registered


class Replicas(DDP):
    """A strategy from outside ddpkit: DDP's behaviour under its own name, built from the cluster's shape
    with a 2-D mesh description (replicas across nodes x ranks of a node, as HSDP describes it)."""

    name = "replicas"

    def __init__(self, options: object, shape: Shape) -> None:
        super().__init__(None)
        self.shape = shape


def build_replicas(options: object, shape: Shape, precision: PrecisionPlan) -> Strategy:
    return Replicas(options, shape.with_mesh(replicate=shape.nodes, shard=shape.local_world_size))


def train_registered(steps: int) -> dict:
    strategies.register("replicas", build_replicas)  # the whole registration
    try:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), ddpkit.session(seed=0, strategy="replicas") as s:
            model = s.model(nn.Linear(4, 1))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            gen = torch.Generator().manual_seed(s.rank)  # different data per rank: only the sync agrees them
            for _ in range(steps):
                with s.accumulate(model):
                    s.backward(model(torch.randn(8, 4, generator=gen)).pow(2).mean())
                s.step(opt)
            chosen = s.strategy
            assert isinstance(chosen, Replicas)
            return {
                "name": chosen.name,
                "mesh": chosen.shape.mesh,
                "said": out.getvalue().splitlines(),
                "weights": torch.cat([p.detach().flatten() for p in model.parameters()]),
            }
    finally:
        registered.pop("replicas")


def test_a_strategy_registered_from_outside_trains_with_its_shape(pool2) -> None:
    r0, r1 = pool2.run(train_registered, 3)
    assert r0["name"] == r1["name"] == "replicas"
    assert r0["mesh"] == (("replicate", 1), ("shard", 2))  # one node of two ranks
    assert torch.equal(r0["weights"], r1["weights"]), "the registered strategy's DDP kept the replicas equal"
    assert r0["said"][0].startswith("ddpkit: strategy replicas over 2 rank(s); mode ddp-cpu, world size 2")
    assert r1["said"] == [], "global rank 0 alone says it"


def fsdp_said() -> list[str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), ddpkit.session(seed=0, strategy="fsdp"):
        pass
    return out.getvalue().splitlines()


def test_an_fsdp_session_says_its_strategy_and_shape_before_the_placement(pool2) -> None:
    first = pool2.run(fsdp_said)[0][0]  # global rank 0's first line
    assert first.startswith("ddpkit: strategy fsdp over 2 rank(s); mode ddp-cpu, world size 2"), first


def test_the_registry_builds_from_values_and_refuses_a_built_in_name() -> None:
    two_nodes = Shape(torch.device("cpu"), rank=3, world_size=4, local_rank=1, local_world_size=2)
    strategies.register("replicas", build_replicas)
    try:
        built = strategies.make("replicas", two_nodes)
        assert isinstance(built, Replicas) and built.shape.mesh == (("replicate", 2), ("shard", 2))
        assert built.shape.nodes == 2 and "replicas" in strategies.registry.names()
    finally:
        registered.pop("replicas")
    with pytest.raises(ddpkit.DdpkitError, match="strategy 'fsdp' is built in"):
        strategies.register("fsdp", build_replicas)
    with pytest.raises(ddpkit.DdpkitError, match="strategy='replicas' is not one of"):
        strategies.make("replicas", two_nodes)  # unregistered again


class Counting(Single):
    def __init__(self) -> None:
        super().__init__()
        self.wrapped = 0

    def wrap(self, module: nn.Module, device: torch.device, options: object = None) -> nn.Module:
        self.wrapped += 1
        return super().wrap(module, device, options)


def test_a_strategy_instance_is_used_as_it_is() -> None:
    mine = Counting()
    with ddpkit.session(strategy=mine, verbose=False) as s:
        model = s.model(nn.Linear(2, 1))
        assert s.strategy is mine and mine.wrapped == 1
        s.backward(model(torch.ones(1, 2)).sum())
        assert s.step(torch.optim.SGD(model.parameters(), lr=0.1)).stepped


def test_a_users_own_tracker_receives_s_log() -> None:
    mine = Recorder()
    with ddpkit.session(log_to=mine, verbose=False) as s:
        s.log({"loss": 0.5, "lr": 0.1}, step=1)
        s.log({"loss": torch.tensor(0.25)}, step=2)
        assert s.tracking.trackers == ["Recorder"]
    assert mine.seen == [(1, {"loss": 0.5, "lr": 0.1}), (2, {"loss": 0.25})]
    assert mine.closed


def test_a_users_tracker_beside_tensorboard(tmp_path) -> None:
    pytest.importorskip("tensorboard")
    mine = Recorder()
    with ddpkit.session(log_to=["tensorboard", mine], log_dir=str(tmp_path), verbose=False) as s:
        s.log({"loss": 1.0}, step=3)
        assert s.tracking.trackers == ["tensorboard", "Recorder"]
    assert mine.seen == [(3, {"loss": 1.0})] and list((tmp_path / "tensorboard").iterdir())


def detect_mine(env: Mapping[str, str]) -> RankEnv | None:
    return RankEnv(launcher="mine") if env.get("MINE_LAUNCHER") else None


def test_a_launcher_detector_of_ones_own_is_asked_first(capsys) -> None:
    with ddpkit.session(env={"MINE_LAUNCHER": "1"}, launcher=detect_mine, device="cpu") as s:
        assert s.plan.ranks.launcher == "mine"
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("ddpkit: strategy single (auto) over 1 rank(s); mode "), first
    assert "world size 1 (mine)" in first


def test_the_shape_carries_nodes_and_a_mesh_that_must_cover_the_ranks() -> None:
    shape = Shape(torch.device("cpu"), rank=5, world_size=8, local_rank=1, local_world_size=4)
    assert (shape.nodes, shape.distributed, shape.mesh) == (2, True, (("shard", 8),))
    assert (
        shape.with_mesh(replicate=2, shard=4).describe()
        == "2 node(s) x 4 rank(s), mesh replicate 2 x shard 4"
    )
    with pytest.raises(ddpkit.DdpkitError, match=r"does not cover the 8 ranks"):
        shape.with_mesh(replicate=3, shard=4)


def test_fsdp_asks_its_shape_for_its_ranks_not_torch_distributed() -> None:
    from pathlib import Path

    source = (Path(ddpkit.__file__).parent / "strategy" / "fsdp.py").read_text()
    assert (
        "get_rank()" not in source and "get_world_size()" not in source and "init_device_mesh" not in source
    )
