"""Locate: the first step, module and operation at which a run parts from one process.

When `verify` fails it says which weights ended up elsewhere; this says where the numbers first went
another way. Both sides train as verify trains them (the reference: one process on the global batch; the
candidate: DDP, FSDP or HSDP on `nproc` ranks, each on its shard), with module hooks recording, per
step and in execution order, every module's forward outputs, the loss, every module's backward
grad-outputs and grad-inputs, and the weights after the step:

    reference = record(one process)            variants = record(rows permuted, other thread count)
    candidate = record(every rank)             floor[step][record] = running max of the variants' spread
    first = the first (step, record) where combine(candidate ranks) - reference > max(10 x floor, 8 eps)
    then, inside that module and phase only, torch's DebugMode records every operation's output on both
    sides: the first operation beyond the same limit is named, with its line of source.

How ranks' records are combined into the reference's shape: a batch-shaped tensor (its rows are the
rank's samples) is put back in the global batch's order (the sampler's interleaved rows, or contiguous
slices for `batches=`); a backward one is divided by the world size, because each rank's gradient is
world x its share of the global one (DDP averages); any other tensor (a loss, a weight's gradient) is
the mean over ranks, as DDP's all-reduce makes it. The rows of each rank are also judged alone, so a
rank-dependent fault names the ranks whose rows differ.

The recording of one run (the hooks, the op window) is `ddpkit.verify.locate_record`; this module
combines the ranks' records, judges them against the floor and reports the place.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import IterableDataset

import ddpkit
from ddpkit.verify import calibrate
from ddpkit.verify.locate_record import Key, Recording, Window, _single, locate_rank
from ddpkit.verify.spec import VerifySpec, build_data


@dataclass(frozen=True)
class Difference:
    """A record or op beyond its limit: its relative difference (||b - a|| / ||a||), max abs, limit."""

    rel_norm: float
    max_abs: float
    limit: float
    floor: float
    ranks: tuple[int, ...] = ()  # ranks whose own rows differ (batch-shaped records)


@dataclass
class Location:
    """The answer: the first step and record that differ, and the first operation inside it."""

    config: str
    world: int = 0
    step: int | None = None
    key: Key | None = None
    window: Window | None = None  # the module (and phase) whose own code made the difference
    kind: str = ""
    difference: Difference | None = None
    agreed: int = 0  # records that agreed before it, in execution order
    op: str | None = None
    op_index: int = 0
    op_difference: Difference | None = None
    op_source: str = ""
    error: str | None = None

    @property
    def found(self) -> bool:
        return self.key is not None

    def render(self) -> str:
        lines = [f"locate: {self.config}"]
        if self.error:
            lines.append(f"the candidate failed: {self.error.splitlines()[0]}")
        if self.key is None or self.difference is None:
            lines.append(
                "no record differs beyond the noise floor: every module's outputs and gradients agree"
            )
            return "\n".join(lines)
        d, kind = self.difference, f" ({self.kind})" if self.kind else ""
        w = self.window
        module = w.module if w else self.key.module
        lines.append(f"first difference: step {self.step}, {self.key.phase} of {module}{kind}")
        lines.append(
            f"  record {self.key.module} {self.key.what}: relative difference {d.rel_norm:.2e} "
            f"(limit {d.limit:.2e}, floor {d.floor:.2e}), max abs {d.max_abs:.2e}; "
            f"{self.agreed} earlier records agreed"
        )
        if d.ranks and len(d.ranks) < self.world:
            lines.append(f"  the rows of rank(s) {', '.join(map(str, d.ranks))} differ; the others agree")
        elif d.ranks:
            lines.append("  the rows of every rank differ")
        if self.op and self.op_difference:
            o = self.op_difference
            where = f" at {self.op_source}" if self.op_source else ""
            lines.append(
                f"  first operation: {self.op} (op {self.op_index + 1} of that {self.key.phase}){where}: "
                f"relative difference {o.rel_norm:.2e}, max abs {o.max_abs:.2e}"
            )
        elif self.op is None:
            lines.append("  no single operation inside it differs beyond the limit")
        return "\n".join(lines)


# -- combining the ranks and judging --------------------------------------------------------------
@dataclass(frozen=True)
class _Layout:
    rows: int  # the global batch's rows
    world: int
    interleaved: bool  # the sampler's rows r, r + W, ... (else contiguous slices)

    def batch_shaped(self, ref: torch.Tensor, part: torch.Tensor) -> bool:
        local = self.rows // self.world
        return (
            ref.dim() > 0
            and part.dim() == ref.dim()
            and part.shape[0] * self.world == ref.shape[0]
            and part.shape[0] % local == 0
            and part.shape[1:] == ref.shape[1:]
        )

    def gather(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """The ranks' rows back in the global batch's order (k rows per sample: a flattened (B, T))."""
        local = self.rows // self.world
        k = parts[0].shape[0] // local
        rest = parts[0].shape[1:]
        pieces = [p.reshape(local, k, *rest) for p in parts]
        whole = torch.stack(pieces, dim=1 if self.interleaved else 0)
        return whole.reshape(self.rows * k, *rest)

    def rank_rows(self, ref: torch.Tensor, rank: int) -> torch.Tensor:
        local = self.rows // self.world
        k = ref.shape[0] // self.rows
        per = ref.reshape(self.rows, k, *ref.shape[1:])
        rows = per[rank :: self.world] if self.interleaved else per[rank * local : (rank + 1) * local]
        return rows.reshape(local * k, *ref.shape[1:])


def _judge(
    phase: str,
    ref: torch.Tensor,
    parts: Sequence[torch.Tensor],
    layout: _Layout,
    floor: float,
    min_rel: float,
    scales: tuple[float, ...] = (),
) -> tuple[float, Difference] | None:
    """How many times its limit the candidate's (combined) value uses; None when the shapes differ.

    `scales` multiply a batch-shaped candidate value before it is compared (default: 1 / world for a
    backward record, the gradients; 1 otherwise); the smallest excess over them counts (an operation in
    backward may compute a gradient or a value from the saved activations)."""
    limit = max(10.0 * floor, min_rel)
    if not scales:
        scales = (1.0 / layout.world,) if phase == "backward" else (1.0,)
    best: tuple[float, Difference] | None = None
    for scale in scales:
        judged = _judge_scaled(phase, ref, parts, layout, limit, floor, min_rel, scale)
        if judged is not None and (best is None or judged[0] < best[0]):
            best = judged
    return best


def _judge_scaled(
    phase: str,
    ref: torch.Tensor,
    parts: Sequence[torch.Tensor],
    layout: _Layout,
    limit: float,
    floor: float,
    min_rel: float,
    scale: float,
) -> tuple[float, Difference] | None:
    ranks: tuple[int, ...] = ()
    if phase == "update":
        devs = [calibrate.deviation(ref, p) for p in parts]
        dev = max(devs, key=lambda d: d.rel_norm)
        ranks = tuple(r for r, d in enumerate(devs) if d.rel_norm > limit)
    elif layout.batch_shaped(ref, parts[0]):
        dev = calibrate.deviation(ref, layout.gather(parts).double() * scale)
        ranks = tuple(
            r
            for r, p in enumerate(parts)
            if calibrate.deviation(layout.rank_rows(ref, r), p.double() * scale).rel_norm > limit
        )
    elif all(p.shape == ref.shape for p in parts):
        dev = calibrate.deviation(ref, torch.stack([p.double() for p in parts]).mean(0))
    else:
        return None
    excess = dev.rel_norm / limit if dev.rel_norm > 0 else 0.0
    if dev.rel_norm == float("inf"):
        excess = float("inf") if dev.max_abs > min_rel else 0.0  # a zero reference: judge the size
    return excess, Difference(dev.rel_norm, dev.max_abs, limit, floor, ranks)


def _floors(reference: Recording, variants: Sequence[Recording]) -> list[dict[Key, float]]:
    """Per step and record: the running maximum of the variants' relative spread (calibrate's rule)."""
    out: list[dict[Key, float]] = []
    running: dict[Key, float] = {}
    for step, records in enumerate(reference.steps):
        theirs = [dict(v.steps[step]) if step < len(v.steps) else {} for v in variants]
        for key, a in records:
            worst = running.get(key, 0.0)
            for t in theirs:
                if key in t and t[key].shape == a.shape:
                    worst = max(worst, calibrate.deviation(a, t[key]).rel_norm)
            running[key] = worst
        out.append(dict(running))
    return out


Runner = Callable[..., Sequence[Any]]  # runner(fn, *args) -> one result per rank, in rank order


@dataclass(frozen=True)
class _Plan:
    spec: VerifySpec
    steps: int
    runner: Runner
    layout: _Layout
    min_rel: float


def locate(spec: VerifySpec, *, runner: Runner | None = None, steps: int | None = None) -> Location:
    """Find the first step, module and operation at which `spec`'s candidate parts from one process.

    `runner(fn, *args)` runs `fn(*args)` on `spec.nproc` ranks (default: `ddpkit.spawn`); `steps`
    defaults to `spec.steps`.
    """
    if runner is None:

        def runner(fn: Callable[..., Any], *args: Any) -> Sequence[Any]:
            return ddpkit.spawn(fn, spec.nproc, args, timeout=spec.timeout, threads=1)

    n = min(steps or spec.steps, spec.steps)
    data = build_data(spec) if spec.data is not None else None
    interleaved = data is not None and not isinstance(data, IterableDataset)
    compute = spec.autocast_dtype or spec.dtype
    plan = _Plan(
        spec, n, runner, _Layout(spec.batch_size, spec.nproc, interleaved), spec.tolerance.min_rel(compute)
    )
    reference = _single(spec, n, 1, False, None)
    variants = [_single(spec, n, 2, False, None)]
    if not reference.random_forward:  # random draws follow the rows' order: no rounding floor then
        variants.append(_single(spec, n, 1, True, None))
    floors = _floors(reference, variants)
    ranks = _candidate(plan, None)
    where = _config(spec, n)
    found = _first(plan, reference, ranks, floors)
    error = next((r.error for r in ranks if r.error), None)
    if found is None:
        return Location(where, spec.nproc, error=error)
    step, index, key, diff = found
    window = reference.windows.get(key) or next(r.windows[key] for r in ranks if key in r.windows)
    loc = Location(
        where,
        spec.nproc,
        step=step,
        key=key,
        window=window,
        difference=diff,
        error=error,
        kind=reference.kinds.get(window.module, ""),
        agreed=sum(len(s) for s in reference.steps[: step - 1]) + index,
    )
    _locate_op(plan, loc, window, diff.floor)
    return loc


def _candidate(plan: _Plan, target: Window | None) -> list[Recording]:
    return [pickle.loads(r) for r in plan.runner(locate_rank, plan.spec, plan.steps, target)]


def _first(
    plan: _Plan, reference: Recording, ranks: Sequence[Recording], floors: list[dict[Key, float]]
) -> tuple[int, int, Key, Difference] | None:
    """The first (step, index, record, difference) beyond its limit, in the reference's order."""
    for step, records in enumerate(reference.steps, start=1):
        if any(len(r.steps) < step for r in ranks):  # the candidate stopped: its first missing step
            key = records[0][0]
            return step, 0, key, Difference(float("inf"), float("inf"), 0.0, 0.0)
        theirs = [dict(r.steps[step - 1]) for r in ranks]
        for index, (key, ref) in enumerate(records):
            if not all(key in t for t in theirs):
                return step, index, key, Difference(float("inf"), float("inf"), 0.0, 0.0)
            judged = _judge(
                key.phase,
                ref,
                [t[key] for t in theirs],
                plan.layout,
                floors[step - 1].get(key, 0.0),
                plan.min_rel,
            )
            if judged is None or judged[0] > 1:
                diff = judged[1] if judged else Difference(float("inf"), float("inf"), 0.0, 0.0)
                return step, index, key, diff
    return None


def _locate_op(plan: _Plan, loc: Location, window: Window, floor: float) -> None:
    """Run both sides again with DebugMode inside `window`; name the first op beyond the limit."""
    short = dataclasses.replace(plan.spec, steps=window.step)
    sub = _Plan(short, window.step, plan.runner, plan.layout, plan.min_rel)
    reference = _single(short, window.step, 1, False, window)
    ranks = _candidate(sub, window)
    phase = "backward" if window.phase == "backward" else "forward"
    seen: dict[str, int] = {}
    theirs = [_by_occurrence(r.ops) for r in ranks]
    for index, (op, ref, source) in enumerate(reference.ops):
        occurrence = seen.get(op, 0)
        seen[op] = occurrence + 1
        parts = [t.get((op, occurrence)) for t in theirs]
        if any(p is None for p in parts):
            continue
        scales = (1.0 / plan.layout.world, 1.0) if phase == "backward" else (1.0,)
        judged = _judge(phase, ref, parts, plan.layout, floor, plan.min_rel, scales)  # type: ignore[arg-type]
        if judged is not None and judged[0] > 1:
            loc.op, loc.op_index, loc.op_difference, loc.op_source = op, index, judged[1], source
            return


def _by_occurrence(ops: list[tuple[str, torch.Tensor, str]]) -> dict[tuple[str, int], torch.Tensor]:
    out: dict[tuple[str, int], torch.Tensor] = {}
    seen: dict[str, int] = {}
    for op, t, _ in ops:
        n = seen.get(op, 0)
        seen[op] = n + 1
        out[(op, n)] = t
    return out


def _config(spec: VerifySpec, steps: int) -> str:
    what = spec.strategy + (" + compile" if spec.compile else "")
    return f"one process against {what} on {spec.nproc} ranks, {steps} step(s), precision {spec.precision}"
