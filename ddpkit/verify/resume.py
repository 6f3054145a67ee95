"""`ddpkit verify --resume`: does a run that saves, stops and resumes end like one that never stopped?

    report = check(ResumeSpec(spec=VerifySpec(model=make_net, data=make_data, steps=8), world=2,
                              setup="mytrain:setup"))        # setup(s, model, opt, loader) -> Resumable
    print(report.render()); assert report.passed

    ddpkit verify --resume --model nets:make_net --data data:train --setup mytrain:setup --steps 8

Exact resume holds only if everything that changes is saved: a scheduler left out of `s.save`, an EMA
copy, a generator of your own, the loader's position, the fp16 loss scale. The algorithm:

    full    = train T steps in fresh processes (world W); at step K: s.save(root, **saved, step=K)
    resumed = fresh processes (world W'): build everything anew, s.load(root, **saved), train K+1..T
    after s.load, then after every step: compare everything both runs hold (weights, optimizer state
    and learning rates, every object your setup returns, s.stepper's loss scale, RNG states, the
    samples of the global batch): bitwise when W' == W (fp32), else within the calibrated tolerance
    (the floor: an uninterrupted run at W' against the one at W, as in `ddpkit verify`)
    the first value that differs names the state that was most likely not saved.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pickle
import random
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

import ddpkit
from ddpkit.errors import problem
from ddpkit.verify import calibrate
from ddpkit.verify.resume_compare import compare, culprit, kind, tensors
from ddpkit.verify.run import digest, map_rows, shard
from ddpkit.verify.spec import VerifySpec, build_data, build_loss, build_model, build_optimizer, resolve

SESSION_PRECISION = {"fp32": "32", "fp64": "32", "bf16": "bf16", "fp16": "16"}


@dataclass
class Resumable:
    """What a training script keeps: `saved` is what it passes to `s.save`/`s.load` (besides step),
    `after_step` what it does after each `s.step` (scheduler.step(), ema.update()), `others` state it
    keeps but does not save (listed so that the check can name it when it matters)."""

    saved: dict[str, Any]
    after_step: Callable[[], None] | None = None
    others: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class ResumeSpec:
    """`spec` gives the model, data, loss, optimizer, global batch, steps T, precision and seed.

    world: ranks of the uninterrupted run and of the first part (default spec.nproc; 1 is allowed).
    resume_world: ranks after the restart (default: the same). save_at: K (default T // 2).
    setup: (s, model, optimizer, loader or None) -> Resumable, your script's extra state; default:
    saves model, optimizer, loader and s.stepper.
    """

    spec: VerifySpec
    world: int | None = None
    resume_world: int | None = None
    save_at: int | None = None
    setup: Callable[..., Resumable] | str | None = None
    timeout: float = 300.0

    @property
    def worlds(self) -> tuple[int, int]:
        first = self.world or self.spec.nproc
        return first, self.resume_world or first

    @property
    def k(self) -> int:
        return self.save_at if self.save_at is not None else self.spec.steps // 2

    def __post_init__(self) -> None:
        if not 1 <= self.k < self.spec.steps:
            raise problem(
                f"save_at={self.k} leaves no step to resume with steps={self.spec.steps}",
                f"Pass 1 <= save_at < steps, e.g. save_at={max(1, self.spec.steps // 2)} with steps >= 2",
            )
        for w in self.worlds:
            if w < 1 or self.spec.batch_size % w:
                raise problem(
                    f"world size {w} does not divide the global batch {self.spec.batch_size}",
                    "Pick world sizes that divide the global batch",
                )


@dataclass
class ResumeReport:
    passed: bool
    bitwise: bool  # the comparison asked for: bitwise (same world size) or within tolerance
    worlds: tuple[int, int]
    steps: int
    save_at: int
    compared: int = 0  # values compared over all snapshots
    difference: dict[str, Any] | None = None  # the first: step, key, detail
    culprit: str | None = None
    fix: str | None = None

    def to_json(self) -> str:
        return json.dumps(self.__dict__, indent=2, default=str)

    def render(self) -> str:
        w, w2 = self.worlds
        how = "bitwise" if self.bitwise else "within the calibrated tolerance"
        head = (
            f"ddpkit verify --resume: {self.steps} steps on {w} rank(s), saved at step {self.save_at}, "
            f"resumed in fresh processes on {w2} rank(s); compared {how} ({self.compared} values)"
        )
        if self.passed:
            same = "bit for bit" if self.bitwise else "within the tolerance"
            return (
                f"{head}\nverdict: PASS, the resumed run matches the uninterrupted one {same} at every step"
            )
        d = self.difference or {}
        where = "right after s.load" if d.get("step") == self.save_at else f"after step {d.get('step')}"
        return (
            f"{head}\nfirst difference {where}: {d.get('key')} ({d.get('detail')})\n"
            f"why: {self.culprit}\nFix: {self.fix}\nverdict: FAIL, the checkpoint does not hold everything "
            "that changes"
        )


# -- one rank of one run --------------------------------------------------------------------------------
def _rank(rs: ResumeSpec, root: str, phase: str) -> bytes:
    """phase "full": T steps, saving at K; "resume": load K, then K+1..T. Snapshots from K on (rank 0)."""
    spec, k = rs.spec, rs.k
    with ddpkit.session(seed=spec.seed, device=spec.device, precision=SESSION_PRECISION[spec.precision],
                        timeout=rs.timeout, verbose=False) as s:  # fmt: skip
        model = s.model(build_model(spec))
        optimizer = build_optimizer(spec, model.parameters())
        loss_fn = build_loss(spec)
        loader = None
        if spec.data is not None:
            loader = s.loader(
                build_data(spec), batch_size=spec.batch_size, shuffle=spec.shuffle, drop_last=True
            )
        setup = resolve(rs.setup, "setup") if rs.setup is not None else None
        state = setup(s, model, optimizer, loader) if setup else _default(s, model, optimizer, loader)
        if not isinstance(state, Resumable):
            raise problem(
                f"setup returned {type(state).__name__}", "Return ddpkit.verify.resume.Resumable(...)"
            )
        start, snaps = 0, []
        if phase == "resume":
            start = int(s.load(root, **state.saved, step=0)["step"])
            snaps.append(_snapshot(s, model, optimizer, state, start, None))
        stream = _batches(spec, s, loader, start)
        for step in range(start + 1, spec.steps + 1):
            batch = next(stream)
            with s.accumulate(model):
                loss = loss_fn(model, _precision(spec, batch))
                s.backward(loss)
            s.step(optimizer)
            if state.after_step is not None:
                state.after_step()
            if step >= k:
                snaps.append(_snapshot(s, model, optimizer, state, step, (batch, loss)))
            if phase == "full" and step == k:
                s.save(root, **state.saved, step=k)
        return pickle.dumps(snaps if s.is_main else [])


def _default(s: Any, model: nn.Module, optimizer: Any, loader: Any) -> Resumable:
    saved = {"model": model, "optimizer": optimizer, "stepper": s.stepper}
    if loader is not None:
        saved["loader"] = loader
    return Resumable(saved=saved)


def _batches(spec: VerifySpec, s: Any, loader: Any, start: int) -> Any:
    if loader is not None:
        while True:
            yield from loader
    source, step = resolve(spec.batches, "batches"), start
    while True:
        whole = source(step)
        step += 1
        yield ddpkit.data.to_device(shard(whole, s.rank, s.world_size, interleaved=False), s.device)


def _precision(spec: VerifySpec, batch: Any) -> Any:
    if spec.precision != "fp64":
        return batch
    return map_rows(batch, lambda t: t.double() if t.is_floating_point() else t)


def _snapshot(s: Any, model: nn.Module, optimizer: Any, state: Resumable, step: int, trained: Any) -> dict:
    """Every value the two runs must agree on, flattened to `key -> tensor or plain value`."""
    everything = {**state.saved, **state.others}
    out: dict[str, Any] = {"step": step, "_kinds": {n: kind(o) for n, o in everything.items()},
                           "_saved": sorted(state.saved)}  # fmt: skip
    if trained is not None:
        batch, loss = trained
        rows = [digest(map_rows(batch, lambda t, i=i: t[i : i + 1])) for i in range(_rows(batch))]  # type: ignore[misc]
        everyone = s.gather_object(rows) if s.distributed else [rows]
        out["data.global_batch"] = hashlib.sha1(
            "".join(sorted(row for rank in everyone for row in rank)).encode()
        ).hexdigest()[:16]
        out["loss"] = float(s.all_reduce(loss.detach().float(), op="mean"))
    full = s.strategy.full_state(model) if s.strategy.shards_state else ddpkit.unwrap(model).state_dict()
    _flatten(out, "model", dict(full))
    _flatten(out, "optimizer", s.stepper.optimizer_state(optimizer))
    _flatten(out, "stepper", s.stepper.state_dict())
    for name, obj in everything.items():
        if obj is model or obj is optimizer or obj is s.stepper:
            continue
        _flatten(out, name, _state_of(obj))
    out["rng.torch"] = torch.get_rng_state()
    out["rng.numpy"] = digest(torch.from_numpy(np.random.get_state()[1].astype(np.int64)))  # type: ignore[index]
    out["rng.python"] = hashlib.sha1(repr(random.getstate()).encode()).hexdigest()[:16]
    return out


def _rows(batch: Any) -> int:
    found: list[int] = []

    def note(t: torch.Tensor) -> torch.Tensor:
        found.append(t.shape[0])
        return t

    map_rows(batch, note)
    return found[0] if found else 0


def _state_of(obj: Any) -> Any:
    if isinstance(obj, torch.Generator):
        return obj.get_state()
    if hasattr(obj, "state_dict"):
        return obj.state_dict()
    return obj


def _flatten(out: dict[str, Any], prefix: str, value: Any) -> None:
    if isinstance(value, Mapping):
        for key, item in value.items():
            _flatten(out, f"{prefix}.{key}", item)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _flatten(out, f"{prefix}.{i}", item)
    elif isinstance(value, torch.Tensor):
        out[prefix] = value.detach().clone().cpu()
    elif value is None or isinstance(value, (bool, int, float, str)):
        out[prefix] = value
    # functions (a LambdaLR's lambdas are not in its state_dict anyway) and other objects: not compared


# -- the check --------------------------------------------------------------------------------------------
def check(rs: ResumeSpec) -> ResumeReport:
    """Run the uninterrupted and the resumed run in fresh processes and compare them."""
    w, w2 = rs.worlds
    spec = rs.spec
    report = ResumeReport(passed=False, bitwise=w == w2 and spec.precision in ("fp32", "fp64"),
                          worlds=(w, w2), steps=spec.steps, save_at=rs.k)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="ddpkit-resume-") as tmp:
        full = _spawn(rs, w, tmp + "/ckpt", "full")
        resumed = _spawn(rs, w2, tmp + "/ckpt", "resume")
        floor = None
        if not report.bitwise:
            other = _spawn(rs, w2, tmp + "/floor", "full")  # rounding of another world size, no resume
            floor = calibrate.floors(tensors(full), [tensors(other)])
    report.compared, report.difference = compare(full, resumed, floor, spec.tolerance, spec.steps)
    report.passed = report.difference is None
    if report.difference is not None:  # not passed
        meta = full[0] if full else {}
        report.culprit, report.fix = culprit(
            report.difference, meta, save_at=rs.k, dataset=spec.data is not None
        )
    return report


def _spawn(rs: ResumeSpec, world: int, root: str, phase: str) -> list[dict]:
    results = ddpkit.spawn(_rank, world, (rs, root, phase), timeout=rs.timeout, threads=1)
    return pickle.loads(results[0])


def main(ns: argparse.Namespace, spec: VerifySpec) -> int:
    """`ddpkit verify --resume ...`: 0 when the resumed run matches, 1 when it does not."""
    rs = ResumeSpec(spec=spec, world=ns.nproc, resume_world=ns.resume_nproc, save_at=ns.save_at,
                    setup=ns.setup, timeout=ns.timeout)  # fmt: skip
    report = check(rs)
    print(report.to_json() if ns.json == "-" else report.render(), flush=True)
    if ns.json and ns.json != "-":
        with open(ns.json, "w") as f:
            f.write(report.to_json() + "\n")
    return 0 if report.passed else 1
