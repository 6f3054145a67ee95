"""Why DDP did not train the same weights, in plain words, from what the two runs recorded.

Each rule looks for the fingerprint of one classic mistake, roughly in the order the mistake acts:
the DDP run stopped (unused parameters) -> the weights differed before the first step (per-rank
initialisation, weights changed after wrapping) -> the ranks trained on other data -> the gradients
differ by the world size (a summed loss) -> batch statistics per rank (BatchNorm) -> randomness in
forward (dropout) -> the replicas drifted apart during training -> no known cause.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from ddpkit.data import plan_batch
from ddpkit.verify.report import Diagnosis, Report
from ddpkit.verify.run import Trajectory
from ddpkit.verify.spec import VerifySpec
from ddpkit.verify.token_mean import diagnose_token_mean

Runs = Sequence[Trajectory]  # the DDP ranks' records, in rank order


def diagnose(
    spec: VerifySpec, single: Trajectory, ranks: Sequence[Trajectory], report: Report
) -> list[Diagnosis]:
    """All the diagnoses that apply; "cause" ones explain the failure, "warning" ones are risks."""
    found: list[Diagnosis] = []
    rules = (_stopped, _init, _after_wrap, _data, _grad_scale, diagnose_token_mean, _batchnorm, _dropout)
    for rule in (*rules, _not_compiled):
        found.extend(rule(spec, single, ranks, report))
    if not any(d.severity == "cause" for d in found):  # a drift the causes above do not already explain
        found.extend(_replicas(spec, single, ranks, report))
    if not report.passed and not any(d.severity == "cause" for d in found):
        found.append(_unexplained(spec, report))
    return found


def _not_compiled(spec: VerifySpec, single: Trajectory, ranks: Runs, report: Report) -> list[Diagnosis]:
    """--compile asked, yet torch.compile built no graph on the DDP/FSDP side: eager compared with eager."""
    if not spec.compile or spec.nproc == 1 or ranks[0].error or ranks[0].graphs_compiled > 0:
        return []
    return [
        Diagnosis(
            "not_compiled",
            "cause",
            "--compile was asked, but torch.compile built no graph on the DDP/FSDP side (every frame ran "
            "eagerly: skipped by Dynamo, or compiled earlier in this process and disabled), so this run did "
            "not check the compiled model.",
            "Run with TORCH_LOGS=graph_breaks,recompiles to see why Dynamo skipped the model's forward, and "
            "check that TORCHDYNAMO_DISABLE and torch.compiler.disable are not in effect.",
        )
    ]


def _names(names: Sequence[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _stopped(spec: VerifySpec, single: Trajectory, ranks: Runs, report: Report) -> list[Diagnosis]:
    failed = [r for r in ranks if r.error]
    unused = [name for name, grad in single.grads.items() if grad is None]
    if unused and not spec.find_unused_parameters:
        severity = "cause" if failed else "warning"
        what = f"DDP stopped at step {failed[0].error_step}: " if failed else ""
        div = report.replica_divergence
        silent = (
            f" Before that, the gradient bucket holding them was never all-reduced, so in step {div['step']} "
            "each rank applied its own local gradients and the replicas drifted apart."
            if div and div["step"] > 0
            else ""
        )
        return [
            Diagnosis(
                "unused_parameters",
                severity,
                f"{what}parameter(s) {_names(unused)} got no gradient (they take no part in the loss). DDP "
                "counts on a gradient from every parameter to finish its all-reduce, so the next step fails "
                f"with 'Expected to have finished reduction in the prior iteration'.{silent}",
                "pass find_unused_parameters=True (s.model(..., find_unused_parameters=True), or "
                "--find-unused-parameters), or remove those parameters or freeze them (requires_grad=False).",
            )
        ]
    if failed:
        first = failed[0]
        return [
            Diagnosis(
                "ddp_error",
                "cause",
                f"the DDP run raised on rank {first.rank} at step {first.error_step}: "
                f"{first.error.splitlines()[0] if first.error else ''}",
                "run the same code with `ddpkit run --nproc 2` to see the full traceback, and fix that "
                "first.",
            )
        ]
    return []


def _init(spec: VerifySpec, single: Trajectory, ranks: Runs, report: Report) -> list[Diagnosis]:
    hashes = [r.init_hash for r in ranks]
    per_rank = len(set(hashes)) > 1
    if not per_rank and hashes[0] == single.init_hash:
        return []
    fix = (
        "build the model from torch's global generator, which ddpkit.session(seed=...) seeds the same on "
        "every rank; do not seed inside the factory from the rank, the process id or the clock."
    )
    if per_rank:
        differs = hashes[0] != single.init_hash
        tail = (
            "and rank 0's weights are not those of the single-process run, so the two runs start apart."
            if differs
            else "here rank 0 happened to build the single run's weights, so training still matched."
        )
        return [
            Diagnosis(
                "per_rank_init",
                "cause" if differs else "warning",
                f"the model factory built different initial weights on each rank ({len(set(hashes))} "
                "different sets over "
                f"{len(ranks)} ranks): it draws random numbers that depend on the process. DDP copies "
                "rank 0's "
                f"weights to every rank when it wraps the model, so the replicas agree, {tail}",
                fix,
            )
        ]
    return [
        Diagnosis(
            "per_rank_init",
            "cause",
            "the model factory built other initial weights in the DDP ranks than in the single-process run "
            "with the same seed: its random numbers depend on the process or the world size.",
            fix,
        )
    ]


def _after_wrap(spec: VerifySpec, single: Trajectory, ranks: Runs, report: Report) -> list[Diagnosis]:
    ddp = ranks[0]
    fix = (
        "change weights before s.model (load a checkpoint into the plain module, on every rank), or do it "
        "identically on every rank; DDP broadcasts parameters only once, when it wraps the model."
    )
    if ddp.replica_diff and ddp.replica_diff[0]:
        names = list(ddp.replica_diff[0])
        return [
            Diagnosis(
                "changed_after_wrap",
                "cause",
                f"before the first step the replicas already differ in {_names(names)}, although DDP made "
                "them "
                "equal when it wrapped the model: the code after s.model changed the weights on some ranks "
                "only (a checkpoint loaded on rank 0 only, or a re-initialisation drawing from each rank's "
                "own random stream). The replicas then train apart.",
                fix,
            )
        ]
    start_over = [r.name for r in report.tensors if r.first_step_over == 0]
    if start_over and len({r.init_hash for r in ranks}) == 1 and ranks[0].init_hash == single.init_hash:
        return [
            Diagnosis(
                "changed_after_wrap",
                "cause",
                f"the factory built the same weights in both runs, but before the first step "
                f"{_names(start_over)} differ: the code after s.model changes them differently with "
                f"{spec.nproc} ranks than with one.",
                fix,
            )
        ]
    return []


def _data(spec: VerifySpec, single: Trajectory, ranks: Runs, report: Report) -> list[Diagnosis]:
    for step, expected in enumerate(single.batch_hashes):
        got = [r.batch_hashes[step][0] if step < len(r.batch_hashes) else None for r in ranks]
        if None in got or got == expected:
            continue
        bad = [r for r, (g, e) in enumerate(zip(got, expected, strict=True)) if g != e]
        if len(set(got)) == 1 and len(set(expected)) > 1:
            what = (
                f"at step {step + 1} every rank trained on the same batch, so the ranks repeat each other's "
                "work instead of splitting the global batch"
            )
        else:
            what = (
                f"at step {step + 1} rank(s) {_names([str(b) for b in bad])} trained on other samples than "
                "their "
                "shard of the single run's global batch: the data depend on the process (a data set "
                "generated or augmented with per-rank random numbers, files chosen by rank, or a batch "
                "source drawing from the global generator, which ddpkit moves to a per-rank stream after "
                "s.model)"
            )
        return [
            Diagnosis(
                "data_mismatch",
                "cause",
                what + ".",
                "make the data a function of the seed alone (a torch.Generator with a fixed seed), read the "
                "same "
                "data on every rank, and let s.loader's DistributedSampler shard it.",
            )
        ]
    return []


def _grad_scale(spec: VerifySpec, single: Trajectory, ranks: Runs, report: Report) -> list[Diagnosis]:
    ddp = ranks[0]
    if ddp.init_hash != single.init_hash:  # other starting weights: other gradients, no scale to read
        return []
    ratios = []
    for name, g in single.grads.items():
        h = ddp.grads.get(name)
        if g is not None and h is not None and float(g.double().norm()) > 0:
            ratios.append(float(h.double().norm()) / float(g.double().norm()))
    if not ratios:
        return []
    ratio, n = statistics.median(ratios), spec.nproc
    for factor, words in ((1 / n, f"1/{n} of"), (float(n), f"{n} times")):
        if abs(ratio / factor - 1) < 0.05:
            summed = factor < 1
            return [
                Diagnosis(
                    "sum_loss" if summed else "scaled_loss",
                    "cause" if not report.passed else "warning",
                    f"the DDP gradients are {words} the single run's (median ratio {ratio:.4g} over "
                    f"{len(ratios)} parameters): "
                    + (
                        "the loss is summed over the batch (reduction='sum'). DDP averages gradients over "
                        f"the {n} ranks, so each step uses the sum over one shard, 1/{n} of the sum over the "
                        "global batch."
                        if summed
                        else f"the loss is multiplied by the world size ({n}) on top of DDP's averaging."
                    ),
                    "use a loss averaged over the batch (reduction='mean', the default), as DDP's gradient "
                    "averaging assumes; or scale the summed loss by the world size."
                    if summed
                    else "drop the extra factor: DDP already averages the gradients over the ranks.",
                )
            ]
    return []


def _batchnorm(spec: VerifySpec, single: Trajectory, ranks: Runs, report: Report) -> list[Diagnosis]:
    if not single.batchnorm or spec.sync_batchnorm or report.passed:
        return []
    per_rank = plan_batch(spec.batch_size, None, world_size=spec.nproc).per_rank  # the loader's split
    buffers = sorted({n for diff in ranks[0].replica_diff for n in diff if "running_" in n})
    extra = (
        f" Their running statistics even differ between the replicas ({_names(buffers, 2)})."
        if buffers
        else ""
    )
    return [
        Diagnosis(
            "batchnorm",
            "cause",
            f"the model has BatchNorm layer(s) ({_names(single.batchnorm)}) that compute the batch mean and "
            f"variance on each rank's {per_rank} samples instead of the global batch of {spec.batch_size}, "
            "so "
            f"normalisation, gradients and running statistics differ from the single run.{extra}",
            "convert them to synchronised BatchNorm: s.model(..., sync_batchnorm=True) (ddpkit verify "
            "--sync-batchnorm), which computes the statistics over the global batch.",
        )
    ]


def _dropout(spec: VerifySpec, single: Trajectory, ranks: Runs, report: Report) -> list[Diagnosis]:
    if not single.random_forward:
        return []
    where = f"({_names(single.dropout)})" if single.dropout else "(the global generator's state changed)"
    return [
        Diagnosis(
            "random_forward",
            "cause",
            f"the model or the loss draws random numbers in forward {where}: every rank draws its own "
            "dropout masks (ddpkit gives each rank its own random stream, as it should), which cannot be the "
            "masks of the single run, so the two agree in distribution only, and the noise floor (which "
            "draws other masks too) says nothing about rounding.",
            "verify with the randomness off (dropout p=0); DDP does not change what dropout does.",
        )
    ]


def _replicas(spec: VerifySpec, single: Trajectory, ranks: Runs, report: Report) -> list[Diagnosis]:
    div = report.replica_divergence
    if not div or div["step"] == 0:
        return []
    names = list(div["tensors"])
    if (
        single.batchnorm
        and not spec.sync_batchnorm
        and all("running_" in n or "num_batches" in n for n in names)
    ):
        return []  # explained by the BatchNorm diagnosis
    return [
        Diagnosis(
            "replica_divergence",
            "cause",
            f"the replicas started identical but their bits differ after step {div['step']} in "
            f"{_names(names)}: "
            "something after backward is not the same on every rank (gradients modified on some ranks, "
            "clipping by a per-rank norm, a per-rank learning rate, or non-deterministic kernels).",
            "keep everything between loss.backward() and optimizer.step() identical on every rank; DDP "
            "guarantees identical gradients only as the all-reduce leaves them.",
        )
    ]


def _unexplained(spec: VerifySpec, report: Report) -> Diagnosis:
    worst = report.worst
    where = (
        f"{worst.name} first at step {worst.first_step_over}, {worst.excess:.3g} x its tolerance"
        if worst
        else ""
    )
    return Diagnosis(
        "unexplained",
        "cause",
        f"DDP moved further from the single run than {spec.tolerance.floor_multiple:g} x the noise floor "
        f"({where}), "
        "and none of the known mistakes fits. Batch-wide operations (losses over pairs of samples, "
        "normalisation over the batch) or a model that amplifies rounding strongly can do this.",
        "run again with precision='fp64': if the deviation shrinks by orders of magnitude it is rounding "
        "amplified by the model; otherwise look for code that sees the whole batch.",
    )
