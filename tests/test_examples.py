"""The course scenarios in examples/, each asserted: the numbers of the lecture, reproduced on gloo ranks."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # `examples.<name>` for this process and the rank pools started after

from ddpkit.verify import verify  # noqa: E402
from examples import cifar_cnn, linear_equivalence, manual_allreduce, sampler_epochs  # noqa: E402

pytestmark = pytest.mark.numerics  # .ci/run runs these again under ATEN_CPU_CAPABILITY=default


def on_rank(module: str, function: str):
    """Run examples.<module>.<function>() on a pool rank (whose sys.path may predate this file)."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    return getattr(importlib.import_module(f"examples.{module}"), function)()


def add_repo_path(repo: str) -> None:
    if repo not in sys.path:
        sys.path.insert(0, repo)


def pool_runner(pool):
    def run(fn, spec):
        pool.run(add_repo_path, str(REPO))
        return pool.run(fn, spec, timeout=120)

    return run


def test_manual_allreduce_by_hand_reproduces_the_lecture_numbers(pool2) -> None:
    r0, r1 = pool2.run(on_rank, "manual_allreduce", "by_hand")
    assert (r0["local_grad"], r1["local_grad"]) == (-180.0, -720.0)
    assert r0["averaged_grad"] == r1["averaged_grad"] == -450.0
    assert r0["weight"] == r1["weight"] == 46.0 and r0["weights_all_equal"] and r1["weights_all_equal"]


def test_manual_allreduce_with_real_ddp_and_with_one_process_give_the_same(pool2) -> None:
    r0, r1 = pool2.run(on_rank, "manual_allreduce", "with_ddp")
    assert r0["averaged_grad"] == r1["averaged_grad"] == -450.0
    assert r0["weight"] == r1["weight"] == 46.0 and r0["weights_all_equal"] and r1["weights_all_equal"]
    single = manual_allreduce.one_process()
    assert single["averaged_grad"] == -450.0 and single["weight"] == 46.0


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_tour_every_rank_holds_what_it_should(world: int, pool2, pool3) -> None:
    results = (pool2 if world == 2 else pool3).run(on_rank, "collectives_tour", "tour")
    for rank, result in enumerate(results):
        assert result["got"]["rank_world"] == [rank, world]
        assert result["got"] == result["expected"], f"rank {rank}"


def test_sampler_and_set_epoch_duplicate_work_repeated_order_and_the_fix(pool2) -> None:
    per_rank = pool2.run(on_rank, "sampler_epochs", "read_three_ways")
    facts = sampler_epochs.summary(per_rank)
    assert facts["no_sampler"] == {"ranks_overlap": True, "all_samples_covered": True, "order_repeats": False}
    assert per_rank[0]["no_sampler"] == per_rank[1]["no_sampler"], "every rank reads the same 16 samples"
    assert facts["no_set_epoch"] == {
        "ranks_overlap": False,
        "all_samples_covered": True,
        "order_repeats": True,
    }
    fixed = {"ranks_overlap": False, "all_samples_covered": True, "order_repeats": False}
    assert facts["set_epoch"] == facts["ddpkit_loader"] == fixed
    assert per_rank[0]["set_epoch"] == per_rank[0]["ddpkit_loader"], "s.loader shards as DistributedSampler"


def test_cifar_tutorial_cnn_20_sgd_momentum_steps_agree(pool2) -> None:
    report = verify(cifar_cnn.spec(steps=20), runner=pool_runner(pool2))
    assert report.passed, report.render()
    assert report.replicas_identical
    # Stricter than verify's pass: within its floor-or-eps limit without the allowance for rare discrete
    # events (update_fraction). The floor is calibrated in this run on this machine's kernels (3e-8 on the
    # native AVX2 path, 1.7e-6 under ATEN_CPU_CAPABILITY=default, where a fixed 1e-6 failed).
    tol = report.tolerance
    bound = max(tol["floor_multiple"] * report.floor["max_rel_norm"], tol["eps_multiple"] * 1.19e-7)
    assert max(r.rel_norm for r in report.tensors) <= bound, (bound, report.render())
    assert report.losses["single"][0] != report.losses["single"][-1], "the net trained"


def test_linear_model_on_4_ranks_equals_one_process(pool4) -> None:
    # The course's 4 ranks (1 thread each), from the shared pool: the claim is the numbers, not the launch
    # (verify's own launcher is the command-line tests' of test_verify, test_compile and test_hsdp).
    report = verify(linear_equivalence.spec(nproc=4), runner=pool_runner(pool4))
    assert report.passed, report.render()
    weight = next(r for r in report.tensors if r.name == "weight")
    assert weight.rel_norm < 1e-6 and weight.max_abs_diff < 1e-6
    assert report.config["steps"] == 1 and report.config["batch_size"] == 20
