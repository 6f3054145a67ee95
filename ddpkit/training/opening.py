"""Opening a session from the process's environment: `ddpkit.session(...)`.

    with ddpkit.session(seed=0, accumulation=4) as s:   # reads the launcher's env, joins the group
        ...

What it decides before the `Session` exists: the placement (`ddpkit.cluster.topology.resolve`: the
launcher, the device, the backend, GPUs shared or not), the limits every wait is bounded by
(`ddpkit.cluster.lifecycle.Limits`), and the accumulation per rank (a `Global` count divided by the
world size; the one an elastic relaunch on fewer ranks needs to keep the global batch:
`ddpkit.data.batching`, said at the start). It then starts the session and,
whatever happens inside the block, closes it; a failure is reported for `ddpkit run` first
(`ddpkit.cluster.lifecycle.on_failure`: who failed first, a stalled collective explained).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from ddpkit.cluster import lifecycle, topology
from ddpkit.cluster.environments import Detector
from ddpkit.cluster.lifecycle import Limits
from ddpkit.data.batching import Global, resolve_accumulation
from ddpkit.observe.profiling import ProfileOptions
from ddpkit.observe.tracking import LogTo
from ddpkit.parallel.precision import PrecisionPlan
from ddpkit.step import spikes
from ddpkit.step.fingerprint import FINGERPRINT_EVERY
from ddpkit.strategy import Choice
from ddpkit.training.session import Session


@contextmanager
def session(
    *,
    seed: int = 0,
    device: str = "auto",
    backend: str = "auto",
    accumulation: int | Global = 1,
    precision: str | PrecisionPlan = "32",
    timeout: float = 1800.0,
    rendezvous_timeout: float = 600.0,
    save_timeout: float = 3600.0,
    verbose: bool = True,
    shard_optimizer: bool | str = "auto",
    share_gpu: bool = False,
    strategy: Choice = "auto",
    log_to: LogTo = "auto",
    log_dir: str | None = None,
    env: Mapping[str, str] | None = None,
    hardware: topology.Hardware | None = None,
    reproducible: str | None = None,
    chunk: int | None = None,
    launcher: Detector | None = None,
    micro_batch: str | None = None,
    spike_guard: spikes.SpikeGuard | None = None,
    fingerprint_every: int = FINGERPRINT_EVERY,
    profile: ProfileOptions | Mapping[str, Any] | bool | None = None,
) -> Iterator[Session]:
    """Open a `Session` for this process; the process group is torn down on exit, also on errors.

    `device` ("auto", "cpu", "cuda") and `backend` ("auto", "gloo", "nccl") override the automatic
    choice; `timeout` bounds every collective, `rendezvous_timeout` the start-up meeting of the ranks
    and `save_timeout` a checkpoint save (seconds; see `ddpkit.cluster.lifecycle.Limits`). `precision` is
    "32", "bf16" or "16" (see `ddpkit.parallel.precision`); `accumulation` is the number of micro-batches per
    optimizer step on each rank, or `Global(n)`: n over all ranks, divided by the world size once it is known
    (`Global(batch=B, micro_batch=m)`: B / m of them, and `s.loader(data)` takes B as its global batch;
    `ddpkit.data.batching.Global`). `shard_optimizer` lets each rank update only its share of the
    parameters in `s.step` ("auto": torch's per-parameter optimizers on CPU ranks of one machine; see
    `ddpkit.step.sharding`; not under FSDP, which shards the optimizer state itself); "gradients" also
    reduce-scatters the gradients into each share (ZeRO-2, `ddpkit.step.shard_exchange`). `strategy` is what
    `s.model` does with the model: "auto" (DDP with more than one process), "ddp" or "fsdp" (FSDP2,
    `ddpkit.strategy.fsdp`), their options, a registered strategy or a `Strategy` instance
    (`ddpkit.strategy.registry`); chosen and built once, from the cluster's shape. `share_gpu=True`
    lets more local ranks than GPUs share them round-robin over gloo, for debugging multi-GPU code on
    one card (`ddpkit.cluster.topology`). `log_to` chooses where `s.log` writes ("auto": TensorBoard
    when installed; names, tracker objects of your own, or a list; None) and `log_dir` the run's
    directory (see `ddpkit.observe.tracking`). `env` and `hardware` default to this process's environment
    and machine. `reproducible="any-world"` with `chunk=`: bitwise any world size (`ddpkit.step.invariant`).
    `launcher`: a detector of your own for a launcher ddpkit does not know (`ddpkit.cluster.environments`).
    `micro_batch="auto"`: under `ddpkit.fit`, a step out of memory on any rank is re-run on every rank with
    the micro-batch halved, accumulation doubled (`step.oom`); FSDP: chosen ahead (`training.oom_ahead`).
    `spike_guard=ddpkit.SpikeGuard()`: a step whose loss (under `fit`) or gradient norm stands far above
    its running window is skipped on every rank, decided from values the step already agrees on
    (`ddpkit.step.spikes`). `fingerprint_every=N` (default 100; 0: off): every N optimizer steps the
    replicas (DDP's ranks, HSDP's replicate dimension) compare a hash of their weights and optimizer
    state in one all-reduce of two int64, and a replica that drifted stops every rank at the same step
    (`ddpkit.step.fingerprint`). `profile=True`, a dict or `ProfileOptions(ranks=..., wait=, warmup=,
    active=, stacks=, memory=)`: torch.profiler on those ranks and steps, one trace per rank
    (`ddpkit.observe.profiling`).
    """
    limits = Limits(rendezvous=rendezvous_timeout, collective=timeout, save=save_timeout)  # validated here
    env = os.environ if env is None else env
    plan = topology.resolve(
        env,
        hardware or topology.Hardware.detect(),
        device=device,
        backend=backend,
        share_gpu=share_gpu,
        launcher=launcher,
    )
    given = accumulation
    accumulation, note = resolve_accumulation(
        given, plan.ranks.world_size, env
    )  # Global; ddpkit run --nnodes
    plan = dataclasses.replace(plan, notes=(*plan.notes, note)) if note else plan
    s = Session(
        plan,
        seed=seed,
        accumulation=accumulation,
        precision=precision,
        limits=limits,
        verbose=verbose,
        shard_optimizer=shard_optimizer,
        strategy=strategy,
        log_to=log_to,
        log_dir=log_dir,
        env=env,
        reproducible=reproducible,
        chunk=chunk,
        micro_batch=micro_batch,
        spike_guard=spike_guard,
        fingerprint_every=fingerprint_every,
        profile=profile,
        global_batch=given.batch if isinstance(given, Global) else None,
    )
    try:
        yield s.start()
    except BaseException as exc:
        # for `ddpkit run`: who failed first; a stalled collective, explained
        lifecycle.on_failure(exc, s.rank, s._group)
        raise
    finally:
        s.close()
