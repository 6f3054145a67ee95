"""World-size-invariant training (`ddpkit.step.invariant`): the same weights, bit for bit, on 1, 2, 4 ranks.

Bitwise equality is right here: the mode makes the computation the same by construction (same chunk
shapes, same kernels, the same additions in the same tree, the same per-chunk random draws). The same
runs as plain DDP show the mode is what does it: their hashes differ with the world size.
"""

from __future__ import annotations

import invariant_models
import invariant_ranks
import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddpkit.errors import DdpkitError
from ddpkit.step import invariant
from ddpkit.step.chunktree import TreeSum, combine
from ddpkit.verify import VerifySpec, bitwise


@pytest.mark.numerics
def test_the_tree_is_the_same_split_over_ranks_and_not_a_running_sum():
    g = torch.Generator().manual_seed(0)
    leaves = [torch.randn(1000, generator=g) * 10 ** (i % 5) for i in range(8)]
    whole = TreeSum()
    for leaf in leaves:
        whole.add(leaf.clone())
    by_hand = ((leaves[0] + leaves[1]) + (leaves[2] + leaves[3])) + (
        (leaves[4] + leaves[5]) + (leaves[6] + leaves[7])
    )
    assert torch.equal(whole.total(), by_hand)
    for world in (2, 4):  # each rank's contiguous range, then the ranks' sums along the same tree
        parts = []
        for r in range(world):
            t = TreeSum()
            for leaf in leaves[r * 8 // world : (r + 1) * 8 // world]:
                t.add(leaf.clone())
            parts.append(t.total())
        assert torch.equal(combine(parts), by_hand)
    running = leaves[0].clone()
    for leaf in leaves[1:]:
        running += leaf
    assert not torch.equal(running, by_hand)  # the order matters for these values: the test can fail
    assert whole.peak_buffers == 3


def test_batchnorm_fp16_accumulation_and_a_ragged_tree_are_refused():
    with pytest.raises(DdpkitError, match=r"1 is a BatchNorm1d: its statistics span .*LayerNorm, GroupNorm"):
        invariant.check_model(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    with pytest.raises(DdpkitError, match="with fp16"):
        invariant.configure("any-world", 4, precision="16-mixed")
    with pytest.raises(DdpkitError, match="accumulation=2"):
        invariant.configure("any-world", 4, accumulation=2)
    with pytest.raises(DdpkitError, match="'every-world' is not a mode"):
        invariant.configure("every-world", 4)
    mode = invariant.configure("any-world", 4)
    assert mode is not None
    with pytest.raises(DdpkitError, match=r"global batch 24 is not a power-of-two number of chunks of 4"):
        mode.chunks_of(24)
    tree = TreeSum()
    for _ in range(3):
        tree.add(torch.ones(2))
    with pytest.raises(DdpkitError, match="3 chunk"):
        tree.total()


def _world_errors() -> list[str]:
    """On each rank: what the mode says about this world size, and about a global batch it cannot share."""
    said = []
    try:
        mode = invariant.AnyWorld(4)
        said.append("ok")
        try:
            mode.chunks_of(4 * dist.get_world_size() // 2)
        except DdpkitError as err:
            said.append(str(err))
    except DdpkitError as err:
        said.append(str(err))
    return said


def test_world_sizes_that_are_no_power_of_two_or_do_not_divide_the_chunks_are_refused(pool2, pool3):
    three = pool3.run(_world_errors)[0]
    assert "on 3 ranks" in three[0] and "Run on 1, 2, 4, 8" in three[0]
    two = pool2.run(_world_errors)[0]
    assert two[0] == "ok"
    assert "holds 1 chunk(s) of 4, which 2 ranks cannot share" in two[1]


@pytest.mark.numerics  # .ci/run repeats it under ATEN_CPU_CAPABILITY=default: other hashes, still equal
def test_mlp_cnn_and_gpt_train_the_same_weights_on_1_2_and_4_ranks(pool4):
    """8 AdamW steps, global batch 32 in chunks of 4 (C = 8), shuffled by the loader, at W = 1, 2, 4."""
    names = ["mlp", "cnn", "gpt"]
    ranks = pool4.run(invariant_ranks.train_all, names, ["any-world", "ddp"], timeout=240)
    steps, c = invariant_ranks.STEPS, invariant_ranks.BATCH // invariant_ranks.CHUNK
    ddp_differs = {}
    for name in names:
        hashes = {}
        for mode in ("any-world", "ddp"):
            for world in (1, 2, 4):
                seen = {ranks[r][f"{name}/{mode}/{world}"][0] for r in range(world)}
                assert len(seen) == 1, f"{name} {mode} W={world}: replicas differ {seen}"
                hashes[mode, world] = seen.pop()
        invariant_hashes = {hashes["any-world", w] for w in (1, 2, 4)}
        assert len(invariant_hashes) == 1, f"{name}: any-world hashes differ with the world size {hashes}"
        ddp_differs[name] = len({hashes["ddp", w] for w in (1, 2, 4)}) > 1
        for world in (1, 2, 4):  # the mode ran: every chunk alone, the ranks' sums gathered, no DDP
            counters = ranks[0][f"{name}/any-world/{world}"][1]
            assert counters["chunks"] == steps * c // world
            assert counters["gathers"] == (steps if world > 1 else 0)
    assert ddp_differs["mlp"], "plain DDP with per-rank dropout streams must differ across world sizes"
    assert ddp_differs["cnn"] or ddp_differs["gpt"], ddp_differs


@pytest.mark.numerics
@pytest.mark.timeout(240)  # the pool runs' own limits (120 s each) fire first
def test_verify_bitwise_passes_an_mlp_with_dropout_and_names_a_layer_with_its_own_generator(
    pool_runner, monkeypatch, capsys
):
    """`ddpkit verify --bitwise` as a user runs it: a Noise layer drawing from a generator of its own is
    the first operation whose output differs (global chunk 2, the first chunk of rank 1 at W = 2). The
    command line's entry point in this process, its ranks from the pools (`ddpkit verify`'s own launch is
    the command-line tests' of test_verify, test_compile and test_hsdp)."""
    from ddpkit.verify import cli

    check = bitwise.check
    monkeypatch.setattr(
        bitwise, "check", lambda spec, chunk=4, runner=None: check(spec, chunk=chunk, runner=pool_runner)
    )
    args = [
        "--bitwise",
        "--data",
        "invariant_models:data",
        "--optimizer",
        "adamw",
        "--steps",
        "3",
        "--batch-size",
        "16",
        "--chunk",
        "4",
        "--timeout",
        "100",
    ]
    code = cli.main([*args, "--model", "invariant_models:noisy"])
    said = capsys.readouterr().out
    assert code == 1, said
    assert "first difference: step 1, global chunk 2: the output of module `2` (Noise), call 3" in said, said
    spec = VerifySpec(
        model=invariant_models.mlp,
        data=invariant_models.data,
        optimizer="adamw",
        steps=3,
        batch_size=16,
        timeout=100,
    )
    report = check(spec, chunk=4, runner=pool_runner)
    assert report.passed, report.render()
    assert "bitwise equal (4 tensors x 3 steps)" in report.render()
    refused = bitwise.check(VerifySpec(model=invariant_models.batchnorm, data=invariant_models.data), chunk=4)
    assert not refused.passed and "1 is a BatchNorm1d" in refused.render()
    with pytest.raises(DdpkitError, match="on 3 ranks"):  # before any rank starts
        bitwise.check(
            VerifySpec(model=invariant_models.mlp, data=invariant_models.data, nproc=3, batch_size=48),
            chunk=4,
        )


@pytest.mark.numerics
def test_the_session_option_is_invariant_and_a_run_resumed_on_fewer_ranks_ends_bitwise_equal(pool2, tmp_path):
    """`ddpkit.session(reproducible="any-world", chunk=4)`: 6 steps on 2 ranks = 6 steps on 1 rank = 3 steps
    on 2 ranks, saved, then resumed on 1 rank for 3 more (a scale-down by restart, mid-epoch)."""
    root = str(tmp_path / "ckpt")
    two = pool2.run(invariant_ranks.session_run, None, 6, None, False, None)
    pool2.run(invariant_ranks.session_run, root, 6, 3, False, None)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks' thread count: a kernel splits its sums by threads
    try:
        one = invariant_ranks.session_run(None, 6, None, False, {})
        resumed = invariant_ranks.session_run(root, 6, None, True, {})
    finally:
        torch.set_num_threads(threads)
    assert two[0] == two[1] == one == resumed, (two, one, resumed)
    # the steps show in the session's anatomy (StepMonitor, MFU, the slow rank read it): each phase timed
    for seen in pool2.run(invariant_ranks.anatomy_of_steps, 4, None):
        assert seen["steps"] == 4, seen
        assert all(seen[phase] > 0 for phase in ("forward", "backward", "sync", "optimizer")), seen
    import ddpkit

    for said in pool2.run(invariant_ranks.ddp_loops_refused):  # a loop written for DDP: refused, not run
        assert len(said) == 3, said
        assert "ran through the DDP model in a session with reproducible='any-world'" in said[0], said
        assert said[1].startswith("s.backward: DdpkitError") and "s.invariant.step(model" in said[1], said
        assert said[2].startswith("s.step: DdpkitError") and "s.invariant.step(model" in said[2], said
    with (
        pytest.raises(DdpkitError, match="accumulation=2"),
        ddpkit.session(reproducible="any-world", accumulation=2, env={}, verbose=False),
    ):
        pass
