"""`ddpkit verify --resume`: does a run that saves, stops and resumes end like one that never stopped?

    report = check(ResumeSpec(spec=VerifySpec(model=make_net, data=make_data, steps=8), world=2,
                              setup="mytrain:setup"))        # setup(s, model, opt, loader) -> Resumable
    print(report.render()); assert report.passed

    ddpkit verify --resume --model nets:make_net --data data:train --setup mytrain:setup --steps 8
    ddpkit verify --resume ... --strategy hsdp --nproc 4 --resume-strategy fsdp --resume-nproc 2

Exact resume holds only if everything that changes is saved: a scheduler left out of `s.save`, an EMA
copy, a generator of your own, the loader's position, the fp16 loss scale. The algorithm:

    full    = train T steps in fresh processes (world W); at step K: s.save(root, **saved, step=K)
    resumed = fresh processes (world W'): build everything anew, s.load(root, **saved), train K+1..T
    after s.load, then after every step: compare everything both runs hold (weights, optimizer state
    and learning rates, every object your setup returns, s.stepper's loss scale, RNG states, the
    samples of the global batch): bitwise when the two parts run the same shape (fp32), else within
    the calibrated tolerance (the floor: an uninterrupted run at the resumed shape against the one at
    the first, as in `ddpkit verify`)
    the first value that differs names the state that was most likely not saved.

A shape is a world size and a strategy (`ddpkit.verify.shapes.Part`): DDP(W), FSDP(W), HSDP(R x S),
or one process (W = 1). Each part may have its own, so a checkpoint written under HSDP(2x2) is checked
resumed under FSDP(2) and the other way round (the checkpoint is resharded on load,
`ddpkit.checkpoint.dcp`). Sharded strategies are compared on their gathered state
(`ddpkit.verify.resume_snapshot`), so any two shapes compare value for value.
"""

from __future__ import annotations

import argparse
import functools
import json
import pickle
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

import ddpkit
from ddpkit.errors import problem
from ddpkit.verify import calibrate
from ddpkit.verify.resume_compare import compare, culprit, tensors
from ddpkit.verify.resume_snapshot import snapshot
from ddpkit.verify.run import map_rows, shard
from ddpkit.verify.shapes import Part, foreign, given_degrees, whose
from ddpkit.verify.spec import (
    VerifySpec,
    build_data,
    build_loss,
    build_model,
    build_optimizer,
    resolve,
)

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

    world: ranks of the uninterrupted run and of the first part (default spec.nproc; 1 is allowed),
    under spec.strategy (HSDP: spec.shard ranks per shard group, default half the ranks).
    resume_world: ranks after the restart (default: the same), under resume_strategy (default
    spec.strategy) with resume_shard (HSDP; default spec.shard, else half the ranks).
    save_at: K (default T // 2). setup: (s, model, optimizer, loader or None) -> Resumable, your
    script's extra state; default: saves model, optimizer, loader and s.stepper.
    """

    spec: VerifySpec
    world: int | None = None
    resume_world: int | None = None
    resume_strategy: str | None = None
    resume_shard: int | None = None
    resume_other_degrees: tuple[tuple[str, int], ...] = ()  # `--resume-<degree>-degree` of other degrees
    save_at: int | None = None
    setup: Callable[..., Resumable] | str | None = None
    timeout: float = 300.0

    @property
    def worlds(self) -> tuple[int, int]:
        first = self.world or self.spec.nproc
        return first, self.resume_world or first

    @property
    def parts(self) -> tuple[Part, Part]:
        """The shapes before and after the restart."""
        w, w2 = self.worlds
        spec = self.spec
        again = self.resume_strategy in (None, spec.strategy)
        given = self.resume_given()
        kept = spec.given() if again else {}
        then = {d: v if v is not None else kept.get(d) for d, v in given.items()}
        wrong = foreign(self.resume_strategy or spec.strategy, then)
        if wrong is not None:
            degree, value, owners = wrong
            owner, fix = whose(owners, "--resume-strategy")
            raise problem(f"resume_{degree}={value} (--resume-{degree}-degree) is {owner}", fix)
        return (
            Part.of(w, spec.strategy, spec.given()),
            Part.of(w2, self.resume_strategy or spec.strategy, then),
        )

    def resume_given(self) -> dict[str, int | None]:
        """The layout degrees given for the resumed part (None: the first part's, when its strategy is
        the same, else the builder's rule)."""
        return {"shard": self.resume_shard, **dict(self.resume_other_degrees)}

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
        _ = self.parts  # a strategy or degree that cannot run on its ranks: refused before any rank starts


@dataclass
class ResumeReport:
    passed: bool
    bitwise: bool  # the comparison asked for: bitwise (the same shape) or within tolerance
    worlds: tuple[int, int]
    steps: int
    save_at: int
    shapes: tuple[str, str] = ("", "")  # Part.describe() of each part, e.g. ("HSDP(2x2)", "FSDP(2)")
    ran: tuple[str, str] = ("", "")  # what each part's ranks ran, as their strategy describes it
    compared: int = 0  # values compared over all snapshots
    difference: dict[str, Any] | None = None  # the first: step, key, detail
    culprit: str | None = None
    fix: str | None = None

    def to_json(self) -> str:
        return json.dumps(self.__dict__, indent=2, default=str)

    def render(self) -> str:
        (w, w2), (a, b) = self.worlds, (_under(shape) for shape in self.shapes)
        how = "bitwise" if self.bitwise else "within the calibrated tolerance"
        head = (
            f"ddpkit verify --resume: {self.steps} steps on {w} rank(s){a}, saved at step {self.save_at}, "
            f"resumed in fresh processes on {w2} rank(s){b}; compared {how} ({self.compared} values)"
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


def _under(shape: str) -> str:
    """The report's " under FSDP(2)"; nothing for DDP and one process (the rank count says it)."""
    return f" under {shape}" if shape and not shape.startswith(("DDP", "one")) else ""


# -- one rank of one run --------------------------------------------------------------------------------
def _rank(rs: ResumeSpec, root: str, phase: str, part: Part) -> bytes:
    """phase "full": T steps, saving at K; "resume": load K, then K+1..T. Snapshots from K on (rank 0)."""
    spec, k = rs.spec, rs.k
    with ddpkit.session(
        seed=spec.seed,
        device=spec.device,
        precision=SESSION_PRECISION[spec.precision],
        timeout=rs.timeout,
        verbose=False,
        strategy=part.session_strategy(),
    ) as s:
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
            snaps.append(snapshot(s, model, optimizer, state, start, None))
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
                snaps.append(snapshot(s, model, optimizer, state, step, (batch, loss)))
            if phase == "full" and step == k:
                s.save(root, **state.saved, step=k)
        return pickle.dumps(snaps if s.is_main else [])


def _default(s: ddpkit.Session, model: nn.Module, optimizer: Any, loader: Any) -> Resumable:
    saved = {"model": model, "optimizer": optimizer, "stepper": s.stepper}
    if loader is not None:
        saved["loader"] = loader
    return Resumable(saved=saved)


def _batches(spec: VerifySpec, s: ddpkit.Session, loader: Any, start: int) -> Any:
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


# -- the check --------------------------------------------------------------------------------------------
def check(
    rs: ResumeSpec, runner: Callable[[Callable[..., bytes], int, tuple], list[bytes]] | None = None
) -> ResumeReport:
    """Run the uninterrupted and the resumed run in fresh processes and compare them.

    `runner(fn, world, args)` -> the ranks' results, in rank order (default: `ddpkit.spawn`, fresh
    processes); tests pass their rank pools (every run builds its session, model and state anew)."""
    first, then = rs.parts
    spec = rs.spec
    run = runner or functools.partial(_spawn, timeout=rs.timeout)
    report = ResumeReport(
        passed=False,
        bitwise=first == then and spec.precision in ("fp32", "fp64"),
        worlds=rs.worlds,
        steps=spec.steps,
        save_at=rs.k,
        shapes=(first.describe(), then.describe()),
    )
    with tempfile.TemporaryDirectory(prefix="ddpkit-resume-") as tmp:
        full = _snaps(run(_rank, first.world, (rs, tmp + "/ckpt", "full", first)))
        resumed = _snaps(run(_rank, then.world, (rs, tmp + "/ckpt", "resume", then)))
        floor = None
        if not report.bitwise:  # rounding of another shape, no resume
            other = _snaps(run(_rank, then.world, (rs, tmp + "/floor", "full", then)))
            floor = calibrate.floors(tensors(full), [tensors(other)])
    report.ran = tuple(snaps[0].get("_strategy", "") if snaps else "" for snaps in (full, resumed))  # type: ignore[assignment]
    report.compared, report.difference = compare(full, resumed, floor, spec.tolerance, spec.steps)
    report.passed = report.difference is None
    if report.difference is not None:  # not passed
        meta = full[0] if full else {}
        report.culprit, report.fix = culprit(
            report.difference, meta, save_at=rs.k, dataset=spec.data is not None
        )
    return report


def _spawn(fn: Callable[..., bytes], world: int, args: tuple, *, timeout: float) -> list[bytes]:
    return ddpkit.spawn(fn, world, args, timeout=timeout, threads=1)


def _snaps(results: list[bytes]) -> list[dict]:
    return pickle.loads(results[0])  # rank 0's


def resume_spec(ns: argparse.Namespace, spec: VerifySpec) -> ResumeSpec:
    """The check `ddpkit verify --resume` asked for (`ddpkit.verify.cli`'s arguments)."""
    return ResumeSpec(
        spec=spec,
        world=ns.nproc,
        resume_world=ns.resume_nproc,
        resume_strategy=ns.resume_strategy,
        resume_shard=ns.resume_shard_degree,
        resume_other_degrees=tuple(
            (d, v) for d, v in given_degrees(ns, "resume_").items() if d != "shard" and v is not None
        ),
        save_at=ns.save_at,
        setup=ns.setup,
        timeout=ns.timeout,
    )


def main(ns: argparse.Namespace, spec: VerifySpec) -> int:
    """`ddpkit verify --resume ...`: 0 when the resumed run matches, 1 when it does not."""
    report = check(resume_spec(ns, spec))
    print(report.to_json() if ns.json == "-" else report.render(), flush=True)
    if ns.json and ns.json != "-":
        with open(ns.json, "w") as f:
            f.write(report.to_json() + "\n")
    return 0 if report.passed else 1
