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
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import pickle
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._debug_mode import DebugMode
from torch.utils.data import IterableDataset

import ddpkit
from ddpkit.step import tokens
from ddpkit.verify import calibrate
from ddpkit.verify.run import _live, _rng_state, _stream
from ddpkit.verify.spec import VerifySpec, build_data, build_loss, build_model, build_optimizer, resolve

LOSS = "(loss)"  # the loss's records: its value in forward, the ops between the model's output and it
OPTIMIZER = "(optimizer)"  # the update's operations


@dataclass(frozen=True)
class Key:
    """One record of one step: `phase` is forward, loss, backward or update; `module` the path in the
    user's model ("(model)" for the root; a parameter's name for update); `call` counts the module's
    calls in that phase of the step; `what` is output[i], grad_output[i], grad_input[i] or value."""

    phase: str
    module: str
    call: int
    what: str

    def describe(self) -> str:
        call = f" (call {self.call + 1})" if self.call else ""
        return f"{self.phase}, {self.module}{call} {self.what}"


@dataclass(frozen=True)
class Window:
    """Where the op pass records: the ops of `module`'s `phase` at `step` (forward: its forward call;
    backward: between its backward pre-hook and its backward hook; loss: after the model's output until
    the loss; update: the optimizer's step)."""

    step: int
    phase: str
    module: str
    call: int


@dataclass
class Recording:
    """What one process recorded (pickled between ranks and the caller)."""

    rank: int = 0
    world: int = 1
    steps: list[list[tuple[Key, torch.Tensor]]] = field(default_factory=list)
    windows: dict[Key, Window] = field(default_factory=dict)  # each record's op window
    kinds: dict[str, str] = field(default_factory=dict)  # module path -> class name
    ops: list[tuple[str, torch.Tensor, str]] = field(default_factory=list)  # (op, output, source line)
    random_forward: bool = False
    error: str | None = None


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


def _tensors(value: Any) -> list[torch.Tensor | None]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for k in sorted(value, key=str) for t in _tensors(value[k])]
    return [None] if value is None else []


def _keep(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).clone().cpu()


class _Recorder:
    """Module hooks that append every record of the current step, and open DebugMode in one window."""

    def __init__(self, net: nn.Module, target: Window | None, out: Recording) -> None:
        self.out, self.target, self.step = out, target, 0
        self.records: list[tuple[Key, torch.Tensor]] = []
        self.calls: dict[tuple[str, str], int] = {}
        self.open_forward: list[tuple[str, int]] = []  # modules whose forward is running
        self.open_backward: list[tuple[str, int]] = []  # modules whose backward is running
        self._mode: contextlib.ExitStack | None = None
        self._debug: DebugMode | None = None
        self._start = 0  # backward: where the window's operations start in the mode's list
        for name, module in net.named_modules():
            path = name or "(model)"
            out.kinds[path] = type(module).__name__
            module.register_forward_pre_hook(functools.partial(self._pre_forward, path))
            module.register_forward_hook(functools.partial(self._forward, path))
            module.register_full_backward_pre_hook(functools.partial(self._pre_backward, path))
            module.register_full_backward_hook(functools.partial(self._backward, path))

    def new_step(self, step: int) -> None:
        self.step, self.records, self.calls = step, [], {}
        self.open_forward, self.open_backward = [], []

    def _call(self, phase: str, path: str, advance: bool) -> int:
        n = self.calls.get((phase, path), 0)
        if advance:
            self.calls[(phase, path)] = n + 1
        return n

    def add(self, key: Key, value: torch.Tensor | None, window: Window) -> None:
        if value is not None:
            self.records.append((key, _keep(value)))
            self.out.windows.setdefault(key, window)

    def _add_all(self, phase: str, path: str, call: int, what: str, values: Any, window: Window) -> None:
        for i, t in enumerate(_tensors(values)):
            self.add(Key(phase, path, call, f"{what}[{i}]"), t, window)

    # -- the op window: DebugMode, entered and left by the hooks --------------------------------------
    # Forward, the loss and the update: the mode is entered at the window's start and left at its end.
    # Backward: autograd runs each node under the thread state it captured when backward began, so a
    # mode entered in a hook would not outlive the node; `backward_mode` spans the whole backward and
    # the hooks mark where the window's operations start and end in its list.
    def _matches(self, phase: str, module: str, call: int) -> bool:
        t = self.target
        return t is not None and (t.step, t.phase, t.module, t.call) == (self.step, phase, module, call)

    def enter(self, phase: str, module: str, call: int) -> None:
        if not self._matches(phase, module, call):
            return
        if phase == "backward":
            self._start = len(self._debug.operators) if self._debug is not None else 0
            return
        self._mode = contextlib.ExitStack()
        self._debug = self._mode.enter_context(DebugMode(record_stack_trace=True))
        self._mode.enter_context(DebugMode.record_outputs())

    def leave(self, phase: str, module: str, call: int) -> None:
        if not self._matches(phase, module, call) or self._debug is None:
            return
        if phase == "backward":
            self._take(self._debug.operators[self._start :])
            return
        assert self._mode is not None
        self._mode.close()
        self._take(self._debug.operators)
        self._mode = self._debug = None

    @contextlib.contextmanager
    def backward_mode(self) -> Iterator[None]:
        t = self.target
        if t is None or (t.step, t.phase) != (self.step, "backward"):
            yield
            return
        with DebugMode(record_stack_trace=True) as self._debug, DebugMode.record_outputs():
            yield
        self._debug = None

    def _take(self, operators: list[Any]) -> None:
        for op in operators:
            record = getattr(op, "record", None) or {}
            outs = [x for x in _tensors(record.get("output")) if x is not None]
            name = str(getattr(op, "op", ""))
            if name and "empty" not in name and outs and outs[0].is_floating_point():  # empty: no value
                self.out.ops.append((name, _keep(outs[0]), _source(op)))

    # -- the hooks -----------------------------------------------------------------------------------
    def _pre_forward(self, path: str, module: nn.Module, args: Any) -> None:
        call = self._call("forward", path, advance=False)
        if self.open_forward:  # a difference in what a module is fed arose in its parent's own code
            window = Window(self.step, "forward", *self.open_forward[-1])
            self._add_all("forward", path, call, "input", args, window)
        self.open_forward.append((path, call))
        self.enter("forward", path, call)

    def _forward(self, path: str, module: nn.Module, args: Any, output: Any) -> None:
        call = self._call("forward", path, advance=True)
        self.leave("forward", path, call)
        if (path, call) in self.open_forward:
            self.open_forward.remove((path, call))
        self._add_all("forward", path, call, "output", output, Window(self.step, "forward", path, call))
        if path == "(model)":
            self.enter("loss", LOSS, 0)

    def _pre_backward(self, path: str, module: nn.Module, grad_output: Any) -> None:
        if path == "(model)":
            self.leave("backward", LOSS, 0)
        call = self._call("backward", path, advance=False)
        enclosing = self.open_backward[-1] if self.open_backward else (LOSS, 0)
        window = Window(self.step, "backward", *enclosing)
        self._add_all("backward", path, call, "grad_output", grad_output, window)
        self.open_backward.append((path, call))
        self.enter("backward", path, call)

    def _backward(self, path: str, module: nn.Module, grad_input: Any, grad_output: Any) -> None:
        call = self._call("backward", path, advance=True)
        self.leave("backward", path, call)
        if (path, call) in self.open_backward:
            self.open_backward.remove((path, call))
        self._add_all(
            "backward", path, call, "grad_input", grad_input, Window(self.step, "backward", path, call)
        )


def _source(op: Any) -> str:
    """The last frame of the op's Python stack outside torch: the user's line that ran it."""
    stack = getattr(op, "stack_trace", None) or ""
    lines = [ln.strip() for ln in str(stack).splitlines() if ln.strip().startswith("File ")]
    user = [ln for ln in lines if "/torch/" not in ln and "/ddpkit/verify/locate" not in ln]
    return user[-1].replace("File ", "", 1) if user else ""


def _permuted(batch: Any, step: int) -> tuple[Any, torch.Tensor]:
    from ddpkit.verify.run import _leaves, map_rows

    rows = next(_leaves(batch)).shape[0]
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(10_007 + step))
    return map_rows(batch, lambda t: t[order.to(t.device)] if t.shape[0] == rows else t), order


def record(
    spec: VerifySpec, s: ddpkit.Session, steps: int, *, permuted: bool = False, target: Window | None = None
) -> Recording:
    """Train `steps` steps as verify does, recording every module's outputs and gradients per step."""
    out = Recording(rank=s.rank, world=s.world_size)
    loss_fn = build_loss(spec)
    compiled = spec.compile and s.world_size > 1
    model = s.model(build_model(spec), strategy=spec.session_strategy(), compile=compiled)
    net = ddpkit.unwrap(model)
    if spec.after_wrap is not None:
        resolve(spec.after_wrap, "after_wrap")(net, s)
    optimizer = build_optimizer(spec, model.parameters())
    hooks = _Recorder(net, target, out)
    stream = _stream(spec, s, s.world_size)
    autocast = spec.precision_plan(s.device.type).forward_context()
    sharded = s.strategy.shards_state
    step = 0
    try:
        for step in range(1, steps + 1):
            hooks.new_step(step)
            batch, _ = next(stream)
            order = None
            if permuted:
                batch, order = _permuted(batch, step)
            if spec.precision == "fp64":
                from ddpkit.verify.run import _precision_batch

                batch = _precision_batch(spec, batch)
            rng = _rng_state(s.device) if step == 1 else None
            with autocast:
                loss = loss_fn(model, batch)
            if isinstance(loss, tuple):
                loss = tokens.global_mean(s, *loss)
            hooks.leave("loss", LOSS, 0)
            if rng is not None:
                out.random_forward = any(
                    not torch.equal(a, b) for a, b in zip(rng, _rng_state(s.device), strict=True)
                )
            hooks.add(Key("loss", LOSS, 0, "value"), loss, Window(step, "loss", LOSS, 0))
            optimizer.zero_grad(set_to_none=True)
            with (
                hooks.backward_mode(),
                warnings.catch_warnings(),
            ):  # an embedding's input needs no gradient: torch says so
                warnings.filterwarnings("ignore", "Full backward hook is firing")
                hooks.enter("backward", LOSS, 0)
                loss.backward()
            hooks.enter("update", OPTIMIZER, 0)
            optimizer.step()
            hooks.leave("update", OPTIMIZER, 0)
            for name, t in _live(net, sharded).items():
                hooks.add(Key("update", name, 0, "value"), t, Window(step, "update", OPTIMIZER, 0))
            out.steps.append(_unpermute(hooks.records, order))
    except Exception as exc:
        if s.world_size == 1:
            raise
        out.error = f"step {step}: {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-3)}"
    return out


def _unpermute(records: list[tuple[Key, torch.Tensor]], order: torch.Tensor | None) -> list:
    if order is None:
        return records
    inverse, rows = torch.argsort(order), order.numel()
    out = []
    for key, t in records:
        if key.phase != "update" and t.dim() > 0 and t.shape[0] % rows == 0:
            k = t.shape[0] // rows
            t = t.reshape(rows, k, *t.shape[1:])[inverse].reshape(t.shape)
        out.append((key, t))
    return out


def _single(spec: VerifySpec, steps: int, threads: int, permuted: bool, target: Window | None) -> Recording:
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with ddpkit.session(seed=spec.seed, device=spec.device, env={}, verbose=False) as s:
            return record(spec, s, steps, permuted=permuted, target=target)
    finally:
        torch.set_num_threads(saved)


def locate_rank(spec: VerifySpec, steps: int, target: Window | None) -> bytes:
    """One rank of the candidate, its `Recording` pickled; run on `spec.nproc` ranks."""
    with ddpkit.session(
        seed=spec.seed,
        device=spec.device,
        timeout=spec.timeout,
        verbose=False,
        strategy=spec.session_strategy(),
    ) as s:
        return pickle.dumps(record(spec, s, steps, target=target))


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
