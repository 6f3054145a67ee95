"""`verify`: does DDP over N ranks train the same weights as one process on the global batch?

    report = verify(VerifySpec(model=make_net, data=make_data, loss="cross_entropy",
                               optimizer="sgd", nproc=2, steps=10, batch_size=32))
    print(report.render()); assert report.passed

The algorithm:
    reference = train K steps in this process on each global batch          (world size 1)
    variants  = the same, rows of each batch permuted / another thread count (the noise floor)
    ranks     = train K steps with DDP on N ranks, each on its shard         (ddpkit.spawn)
    for every step t and every parameter and buffer:
        deviation(ranks[0][t], reference[t]) <= tolerance(floor of variants up to t)
    and, on the ranks, the bits of every tensor agree across replicas after every step.
"""

from __future__ import annotations

import math
import pickle
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import torch

import ddpkit
from ddpkit.cluster.topology import Hardware, threads_per_process
from ddpkit.verify import calibrate
from ddpkit.verify.diagnose import diagnose
from ddpkit.verify.report import Report, TensorRow
from ddpkit.verify.run import Trajectory, ddp_rank, run_single
from ddpkit.verify.spec import VerifySpec

Runner = Callable[..., Sequence[Any]]  # runner(fn, spec) -> one result per rank, in rank order


def floor_variants(spec: VerifySpec) -> tuple[str, ...]:
    """The variants asked for, plus "features" under tensor parallelism: TP reorders each layer's sum
    over its input features, which permuting rows or chunking the batch never does (measured: TP(2)
    moves a tiny GPT 2.8x the features floor, 8x the rows-permuted one)."""
    if spec.part.layout.tensor > 1 and "features" not in spec.floor:
        return (*spec.floor, "features")
    return spec.floor


def verify(spec: VerifySpec, *, runner: Runner | None = None) -> Report:
    """Run the check described by `spec`; `runner` runs the DDP side (default: `ddpkit.spawn`).

    A runner is any `runner(fn, spec)` that calls `fn(spec)` on `spec.nproc` ranks of an already
    running job and returns their results in rank order (tests pass a pool of live gloo ranks).
    """
    threads = threads_per_process(Hardware.detect().cpu_cores, spec.nproc)
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    reference = run_single(spec, threads=threads)
    seconds["single"] = time.perf_counter() - start
    variants, skipped = [], {}
    for name in floor_variants(spec):
        if name == "chunked" and reference.batchnorm:
            skipped[name] = "the model normalises over the batch (BatchNorm): pieces change its statistics"
            continue
        for pieces in _pieces(spec) if name == "chunked" else [0]:
            run = run_single(spec, variant=name, threads=threads, pieces=pieces)
            drift = abs(run.losses[0] - reference.losses[0]) / max(abs(reference.losses[0]), 1e-30)
            if name == "chunked" and drift > _loss_drift_limit(spec):
                skipped[name] = f"the first loss moved by {drift:.2g}: the model mixes the samples of a batch"
                break
            variants.append(run)
    seconds["floor"] = time.perf_counter() - start - seconds["single"]
    start = time.perf_counter()
    results: Sequence[Any]
    if runner is None:
        results = ddpkit.spawn(ddp_rank, spec.nproc, (spec,), timeout=spec.timeout, threads=threads)
    else:
        results = runner(ddp_rank, spec)
    ranks = [pickle.loads(r) for r in results]
    seconds["ddp"] = time.perf_counter() - start
    report = compare(spec, reference, variants, ranks)
    report.config["floor_skipped"] = skipped
    report.seconds = {k: round(v, 3) for k, v in seconds.items()}
    return report


def _pieces(spec: VerifySpec) -> list[int]:
    """How many pieces the chunked variant cuts the batch into: never DDP's shards. Under bf16/fp16
    autocast every piece's gradient is rounded to a few mantissa bits; one sample of that noise is too
    few (measured: DDP up to 15x one chunked run's deviation, within 2.3x of two runs'), so take two."""
    first = spec.nproc + 1
    return [first, first + 1] if spec.autocast_dtype else [first]


def _loss_drift_limit(spec: VerifySpec) -> float:
    """How far the first loss of a variant may move by rounding alone (its weights are the reference's)."""
    compute = spec.autocast_dtype or spec.dtype
    return max(1e-4, 8 * torch.finfo(compute).eps)


def compare(
    spec: VerifySpec, reference: Trajectory, variants: list[Trajectory], ranks: Sequence[Trajectory]
) -> Report:
    """Judge the DDP run against the reference and its floor; diagnose what went wrong, if anything."""
    ddp = ranks[0]
    floor_by_step = calibrate.floors(reference.states, [v.states for v in variants])
    rows = [_row(spec, name, reference, ddp, floor_by_step) for name in reference.states[0]]
    divergence = next(
        ({"step": step, "tensors": diff} for step, diff in enumerate(ddp.replica_diff) if diff), None
    )
    error = next((r.error for r in ranks if r.error), None)
    tol = asdict(spec.tolerance) | {"min_rel_norm": spec.tolerance.min_rel(spec.dtype)}
    report = Report(
        passed=False,
        config=_config(spec),
        tolerance=tol,
        tensors=rows,
        replicas_identical=divergence is None and error is None,
        replica_divergence=divergence,
        floor=calibrate.floor_summary(floor_by_step),
        losses={"single": reference.losses, "ddp": ddp.losses},
        error=error,
    )
    # Random numbers drawn in forward (dropout) make the permuted reference draw other masks, so its
    # spread is no rounding floor: such a run cannot pass, whatever the numbers say.
    report.config["graphs_compiled"] = ddp.graphs_compiled  # rank 0's; compile=True must have built some
    if spec.shard_optimizer is not None:
        report.config["step_path"] = ddp.step_path  # rank 0's: what the check actually ran
    wanted = "reduce-scattered" if spec.shard_optimizer == "gradients" else "sharded"
    report.passed = (
        error is None
        and (spec.shard_optimizer in (None, False) or wanted in ddp.step_path)  # the path asked for ran
        and divergence is None
        and all(r.passed for r in rows)
        and not reference.random_forward
        and (ddp.graphs_compiled > 0 or not spec.compile or spec.nproc == 1)
    )
    report.diagnoses = diagnose(spec, reference, ranks, report)
    return report


def _row(
    spec: VerifySpec,
    name: str,
    reference: Trajectory,
    ddp: Trajectory,
    floor_by_step: list[dict[str, tuple[float, float]]],
) -> TensorRow:
    first = reference.states[0][name]
    max_abs = max_rel = rel_norm = excess = over_update = 0.0
    first_over: int | None = None
    for step, state in enumerate(ddp.states):
        a, b = reference.states[step][name], state[name]
        dev = calibrate.deviation(a, b)
        update = calibrate.deviation(reference.states[step - 1][name], a) if step > 0 else None
        lim = calibrate.limit(spec.tolerance, a, floor_by_step[step][name], update)
        step_excess = lim.excess(dev)
        if step_excess > 1 and first_over is None:
            first_over = step
        max_abs, max_rel = max(max_abs, dev.max_abs), max(max_rel, dev.max_rel)
        rel_norm, excess = max(rel_norm, dev.rel_norm), max(excess, step_excess)
        if update is not None:
            moved = update.norm
            over_update = max(
                over_update, dev.norm / moved if moved > 0 else (0.0 if dev.norm == 0 else math.inf)
            )
    if len(ddp.states) < len(reference.states) and first_over is None:
        first_over = len(ddp.states)  # the DDP run stopped early: the missing steps did not match
        excess = math.inf
    return TensorRow(
        name=name,
        kind="parameter" if name in reference.params else "buffer",
        dtype=str(first.dtype).replace("torch.", ""),
        numel=first.numel(),
        max_abs_diff=max_abs,
        max_rel_diff=max_rel,
        rel_norm=rel_norm,
        floor_rel_norm=floor_by_step[-1][name][0],
        excess=excess,
        dev_over_update=over_update,
        first_step_over=first_over,
    )


def _config(spec: VerifySpec) -> dict[str, Any]:
    def name(value: Any) -> Any:
        if value is None or isinstance(value, (str, int, float, bool)):
            return value
        qual = getattr(value, "__qualname__", None) or type(value).__qualname__
        return f"{getattr(value, '__module__', '?')}:{qual}"

    return {
        "model": name(spec.model),
        "data": name(spec.data),
        "batches": name(spec.batches),
        "loss": name(spec.loss),
        "optimizer": name(spec.optimizer),
        "optimizer_options": dict(spec.optimizer_options),
        "nproc": spec.nproc,
        "steps": spec.steps,
        "batch_size": spec.batch_size,
        "precision": spec.precision,
        "seed": spec.seed,
        "device": spec.device,
        "sync_batchnorm": spec.sync_batchnorm,
        "find_unused_parameters": spec.find_unused_parameters,
        "strategy": spec.strategy,
        "compile": spec.compile,
        "shard_optimizer": spec.shard_optimizer,
        "floor": list(spec.floor),
    }
