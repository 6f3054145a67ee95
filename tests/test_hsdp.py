"""HSDP (shard inside a node, replicate across nodes) behind the same session, on 4 real gloo ranks with
a forced 2 x 2 shape: the same weights as one process within the calibrated noise floor, FSDP2 on a 2-D
mesh, replicas bitwise equal across replica groups, impossible shapes refused.

Rank functions live in tests/hsdp_ranks.py.
"""

from __future__ import annotations

import pytest
import torch
from hsdp_ranks import refused, resume_refused, trained, verify_rank

pytestmark = pytest.mark.numerics  # .ci/run runs these again under ATEN_CPU_CAPABILITY=default


def test_hsdp_2x2_is_fsdp2_on_a_2d_mesh_with_bitwise_replicas(pool4) -> None:
    ranks = pool4.run(trained, 2, 2)
    assert [r["strategy"] for r in ranks] == ["hsdp"] * 4
    for r in ranks:  # every parameter a DTensor on the (replicate 2, shard 2) mesh: Replicate x Shard(0)
        assert r["meshes"], "no parameter was sharded"
        for name, (dims, sizes, placements) in r["meshes"].items():
            assert dims == ("replicate", "shard") and sizes == (2, 2), (name, dims, sizes)
            assert placements == ["Replicate", "Shard"], (name, placements)
    assert "replicate 2 x shard 2" in ranks[0]["describe"]
    assert "mesh replicate 2 x shard 2" in ranks[0]["printed"], ranks[0]["printed"]  # the start-up notes
    # every rank fed other data: only the all-reduce across replica groups makes the shards agree
    for a, b in ((0, 2), (1, 3)):  # the same shard index in the two replica groups
        assert ranks[a]["local"].keys() == ranks[b]["local"].keys()
        for name in ranks[a]["local"]:
            assert torch.equal(ranks[a]["local"][name], ranks[b]["local"][name]), f"replicas differ: {name}"
    diff = [n for n in ranks[0]["local"] if ranks[0]["local"][n].numel() and ranks[1]["local"][n].numel()
            and ranks[0]["local"][n].shape == ranks[1]["local"][n].shape
            and torch.equal(ranks[0]["local"][n], ranks[1]["local"][n])]  # fmt: skip
    assert len(diff) < len(ranks[0]["local"]), "ranks 0 and 1 hold the same values: nothing is sharded"
    for r in ranks[1:]:  # the whole model, gathered, is the same on every rank
        for name, t in r["whole_after_step"].items():
            assert torch.equal(t, ranks[0]["whole_after_step"][name]), name
    assert ranks[0]["norms"] == ranks[2]["norms"], "the clipped norm differs between replicas"


def test_hsdp_2x2_trains_the_weights_of_one_process(pool4) -> None:
    from fsdp_train import data, net

    from ddpkit.verify import VerifySpec, verify

    spec = VerifySpec(model=net, data=data, optimizer="adamw", steps=6, batch_size=12, nproc=4,
                      strategy="fsdp")  # fmt: skip
    report = verify(spec, runner=lambda fn, spec: pool4.run(verify_rank, spec, 2, 2))
    text = report.render()
    assert report.passed and report.replicas_identical, text


@pytest.mark.parametrize(
    ("replicate", "shard", "within", "says"),
    [
        (3, None, True, "do not cover the 4 ranks"),
        (3, 2, True, "do not cover the 4 ranks"),
        (1, 3, False, "do not cover the 4 ranks"),
    ],
)
def test_impossible_degrees_are_refused_with_the_fix(pool4, replicate, shard, within, says) -> None:
    for message in pool4.run(refused, replicate, shard, within):
        assert says in message and "product is 4" in message, message


def test_shard_group_across_nodes_is_refused_unless_asked() -> None:
    from ddpkit.parallel.shape import Shape
    from ddpkit.strategy.hsdp_options import HSDPOptions

    two_nodes = Shape(torch.device("cpu"), rank=0, world_size=8, local_rank=0, local_world_size=4)
    assert HSDPOptions().degrees(two_nodes) == (2, 4)  # default: shard the node, replicate across nodes
    assert HSDPOptions(shard=2).degrees(two_nodes) == (4, 2)
    with pytest.raises(Exception, match="span nodes") as err:
        HSDPOptions(replicate=1).degrees(two_nodes)
    assert "within_node=False" in str(err.value)
    assert HSDPOptions(replicate=1, within_node=False).degrees(two_nodes) == (1, 8)


def test_hsdp_options_name_the_hsdp_strategy() -> None:
    from ddpkit.strategy import resolve
    from ddpkit.strategy.fsdp_options import FSDPOptions
    from ddpkit.strategy.hsdp_options import HSDPOptions

    assert resolve(HSDPOptions(replicate=2)).name == "hsdp"
    assert resolve(FSDPOptions()).name == "fsdp"
    assert resolve("hsdp").name == "hsdp"


def test_resuming_an_hsdp_checkpoint_is_refused_not_half_loaded(pool4, tmp_path) -> None:
    for message in pool4.run(resume_refused, str(tmp_path / "ckpt")):
        assert "saved under HSDP" in message and "s.export" in message, message
