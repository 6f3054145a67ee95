"""Locate's recording: one run trained as verify trains it, with every module's records kept per step.

Module hooks record, per step and in execution order, every module's forward inputs and outputs, the
loss, every module's backward grad-outputs and grad-inputs, and the weights after the step, each with
the window of code that made it (the module, and phase, whose own operations produced it). Given a
target window, torch's DebugMode records every operation's output inside that window only, with the
line of source that ran it. `ddpkit.verify.locate` compares such recordings of one process and of the
candidate's ranks.
"""

from __future__ import annotations

import contextlib
import functools
import pickle
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._debug_mode import DebugMode

import ddpkit
from ddpkit.step import tokens
from ddpkit.verify.run import _live, _rng_state, _stream
from ddpkit.verify.spec import VerifySpec, build_loss, build_model, build_optimizer, resolve

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
