"""Each classic DDP mistake, planted on purpose: the check must fail and name the cause in plain words.

The DDP side runs on the shared 2-rank gloo pool; every model and function here is at module level so
that the ranks can import it.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from ddpkit.verify import Report, VerifySpec, verify

pytestmark = pytest.mark.numerics  # .ci/run runs these again under ATEN_CPU_CAPABILITY=default


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 3))


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(256, 8, generator=g), torch.randint(0, 3, (256,), generator=g))


def check(pool, **overrides) -> Report:
    spec = VerifySpec(**{"model": mlp, "data": data, "steps": 4, "batch_size": 16, **overrides})
    return verify(spec, runner=pool.run)


def codes(report: Report, severity: str = "cause") -> list[str]:
    return [d.code for d in report.diagnoses if d.severity == severity]


def test_a_correct_setup_passes_with_no_diagnosis(pool2) -> None:
    report = check(pool2)
    assert report.passed, report.render()
    assert report.diagnoses == [] and report.replicas_identical


# -- BatchNorm statistics per rank -----------------------------------------------------------------
def bn_net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 3))


def test_batchnorm_per_rank_is_diagnosed_and_sync_batchnorm_fixes_it(pool2) -> None:
    report = check(pool2, model=bn_net)
    assert not report.passed
    assert codes(report) == ["batchnorm"], report.render()
    text = report.render()
    assert "each rank's 8 samples instead of the global batch of 16" in text and "sync_batchnorm=True" in text
    fixed = check(pool2, model=bn_net, sync_batchnorm=True)
    assert fixed.error is None and fixed.passed, fixed.render()  # ddpkit's SyncBatchNorm runs on CPU


# -- a loss summed over the batch -----------------------------------------------------------------
def summed_ce(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y, reduction="sum")


def test_sum_reduced_loss_shows_gradients_divided_by_world_size(pool2) -> None:
    report = check(pool2, loss=summed_ce)
    assert not report.passed and codes(report) == ["sum_loss"], report.render()
    message = report.diagnoses[0].message
    assert "1/2 of the single run's (median ratio 0.5" in message and "reduction='sum'" in message


# -- parameters changed after wrapping, on one rank only --------------------------------------------
def load_checkpoint_on_main_only(module: nn.Module, s) -> None:
    if s.is_main:  # the classic: rank 0 restores a checkpoint after DDP has already broadcast the weights
        torch.manual_seed(99)
        module.load_state_dict(mlp().state_dict())


def test_weights_changed_after_wrapping_on_some_ranks(pool2) -> None:
    report = check(pool2, after_wrap=load_checkpoint_on_main_only)
    assert not report.passed and codes(report) == ["changed_after_wrap"], report.render()
    assert report.replica_divergence["step"] == 0
    assert "already differ in 0.weight, 0.bias, 2.weight, 2.bias" in report.diagnoses[0].message


# -- per-rank random initialisation ---------------------------------------------------------------
def mlp_seeded_by_process() -> nn.Module:
    torch.manual_seed(os.getpid())  # differs in every process: the single run and each rank
    return mlp()


def test_per_rank_random_initialisation(pool2) -> None:
    report = check(pool2, model=mlp_seeded_by_process)
    assert not report.passed and codes(report) == ["per_rank_init"], report.render()
    assert (
        "different initial weights on each rank (2 different sets over 2 ranks)"
        in report.diagnoses[0].message
    )
    assert report.replicas_identical, "DDP's broadcast at wrap time still makes the replicas agree"
    assert all(r.first_step_over == 0 for r in report.tensors if r.kind == "parameter")


# -- other data on the ranks than in the single run -------------------------------------------------
def data_per_rank() -> TensorDataset:
    g = torch.Generator().manual_seed(int(os.environ.get("RANK", "0")))  # each rank makes its own data
    return TensorDataset(torch.randn(256, 8, generator=g), torch.randint(0, 3, (256,), generator=g))


def test_different_data_on_ranks_than_in_the_single_run(pool2) -> None:
    report = check(pool2, data=data_per_rank)
    assert not report.passed and codes(report) == ["data_mismatch"], report.render()
    assert "at step 1 rank(s) 1 trained on other samples" in report.diagnoses[0].message


def noisy_batches(step: int):
    # Uses the global generator: ddpkit gives each rank its own stream after s.model.
    return torch.randn(16, 8), torch.randint(0, 3, (16,))


def test_batch_source_drawing_from_the_global_generator(pool2) -> None:
    report = check(pool2, data=None, batches=noisy_batches)
    assert not report.passed and codes(report) == ["data_mismatch"], report.render()


# -- unused parameters ------------------------------------------------------------------------------
class WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = mlp()
        self.aux_head = nn.Linear(32, 5)  # built, never called

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_unused_parameters_stop_ddp_and_find_unused_parameters_fixes_it(pool2) -> None:
    report = check(pool2, model=WithUnused)
    assert not report.passed and report.error and codes(report) == ["unused_parameters"], report.render()
    message = report.diagnoses[0].message
    assert "DDP stopped at step 2" in message and "aux_head.weight, aux_head.bias got no gradient" in message
    fixed = check(pool2, model=WithUnused, find_unused_parameters=True)
    assert fixed.passed, fixed.render()


# -- randomness in forward ------------------------------------------------------------------------
def dropout_net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.2), nn.Tanh(), nn.Linear(32, 3))


def test_dropout_masks_differ_per_rank(pool2) -> None:
    report = check(pool2, model=dropout_net)
    assert not report.passed and codes(report) == ["random_forward"], report.render()
    assert "(1)" in report.diagnoses[0].message  # names the Dropout module


def mlp_seeded_by_rank() -> nn.Module:
    torch.manual_seed(int(os.environ.get("RANK", "0")))  # rank 0 happens to match the single run
    return mlp()


def test_per_rank_initialisation_hidden_by_the_broadcast_is_a_warning(pool2) -> None:
    report = check(pool2, model=mlp_seeded_by_rank)
    assert report.passed, report.render()
    assert codes(report, "warning") == ["per_rank_init"] and codes(report) == []
    assert "rank 0 happened to build the single run's weights" in report.diagnoses[0].message


# -- replicas drifting apart during training --------------------------------------------------------
def sgd_with_rank_scaled_lr(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1 * (1 + int(os.environ.get("RANK", "0"))))


def test_replicas_drifting_apart_after_the_first_step(pool2) -> None:
    report = check(pool2, optimizer=sgd_with_rank_scaled_lr)
    assert not report.passed and not report.replicas_identical
    assert report.replica_divergence["step"] == 1
    assert codes(report) == ["replica_divergence"], report.render()
    assert "a per-rank learning rate" in report.diagnoses[0].message
