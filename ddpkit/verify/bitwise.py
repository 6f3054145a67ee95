"""`ddpkit verify --bitwise`: does reproducible="any-world" train your model alike on 1 and N ranks?

    ddpkit verify --bitwise --model nets:make_net --data data:train --optimizer adamw --steps 10 --chunk 4

The same spec as `ddpkit verify` (model, data or batches, loss, optimizer, steps, global batch), trained
with `ddpkit.step.invariant` twice in fresh processes of one thread each: on 1 rank and on `nproc`.
Every rank records, for every step, a digest of every module's output per global chunk and call (forward
hooks), of every parameter's combined gradient, and of every parameter and buffer after the step. The
parent compares the two runs bit for bit and names the first thing that differs, in the order training
computes it: a module's output (the first operation that is not a function of its chunk alone: a
generator of its own, a rank-dependent branch, a collective in forward), else a gradient (the backward
of that parameter), else a weight after the step (the optimizer, or a buffer updated per rank). A model
the mode refuses (BatchNorm) is reported with the refusal, without training.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import ddpkit
from ddpkit.errors import DdpkitError
from ddpkit.step import invariant
from ddpkit.verify.run import shard
from ddpkit.verify.spec import VerifySpec, build_data, build_loss, build_model, build_optimizer, resolve

Key = tuple[int, int, int]  # (step, global chunk, call within the chunk's forward)


@dataclass
class Trace:
    """One rank's digests; `outputs[(step, chunk, call)] = (module name, type, digest)`."""

    rank: int
    world: int
    outputs: dict[Key, tuple[str, str, str]] = field(default_factory=dict)
    grads: list[dict[str, str]] = field(default_factory=list)
    weights: list[dict[str, str]] = field(default_factory=list)


@dataclass
class BitwiseReport:
    passed: bool
    lines: list[str]
    first: str | None = None  # what differs first, in words (None when the runs are equal)

    def render(self) -> str:
        return "\n".join(self.lines)


def _digest(value: Any) -> str:
    h = hashlib.blake2b(digest_size=8)
    for t in _tensors(value):
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def bitwise_rank(spec: VerifySpec, chunk: int) -> bytes:
    """One rank of the check (run by `ddpkit.spawn`); its `Trace`, pickled."""
    with ddpkit.session(seed=spec.seed, device=spec.device, timeout=spec.timeout, verbose=False) as s:
        mode = invariant.AnyWorld(chunk, seed=spec.seed)
        mode.chunks_of(spec.batch_size)
        loss_fn = build_loss(spec)
        model = s.model(build_model(spec))
        net = ddpkit.unwrap(model)
        optimizer = build_optimizer(spec, model.parameters())
        trace = Trace(rank=s.rank, world=s.world_size)
        local = spec.batch_size // chunk // s.world_size
        where = {"step": 0, "chunk": 0, "call": 0}
        names = {sub: name or "(the model)" for name, sub in net.named_modules()}

        def record(module: nn.Module, args: Any, output: Any) -> None:
            key = (where["step"], where["chunk"], where["call"])
            trace.outputs[key] = (names[module], type(module).__name__, _digest(output))
            where["call"] += 1

        def traced(module: nn.Module, part: Any) -> torch.Tensor:
            where["call"] = 0
            loss = loss_fn(module, part)
            where["chunk"] += 1
            return loss

        def grads() -> None:
            trace.grads.append({n: _digest(p.grad) for n, p in net.named_parameters() if p.grad is not None})

        handles = [sub.register_forward_hook(record) for sub in names]
        try:
            for step, batch in zip(range(spec.steps), _batches(spec, s, mode), strict=False):
                where.update(step=step, chunk=s.rank * local)
                mode.step(model, optimizer, batch, traced, inspect=grads)
                trace.weights.append({n: _digest(t) for n, t in net.state_dict().items()})
        finally:
            for h in handles:
                h.remove()
        return pickle.dumps(trace)


def _batches(spec: VerifySpec, s: ddpkit.Session, mode: invariant.AnyWorld) -> Any:
    if spec.data is not None:
        data = build_data(spec)
        options: dict[str, Any] = {}
        shuffle, drop_last = mode.loader_options(data, spec.batch_size, spec.shuffle, options)
        loader = s.loader(data, batch_size=spec.batch_size, shuffle=shuffle, drop_last=drop_last, **options)
        while True:
            yield from loader
    source = resolve(spec.batches, "batches")
    step = 0
    while True:
        yield ddpkit.to_device(shard(source(step), s.rank, s.world_size, interleaved=False), s.device)
        step += 1


Runner = Callable[[Callable[..., bytes], int, tuple], list[bytes]]


def check(spec: VerifySpec, *, chunk: int = 4, runner: Runner | None = None) -> BitwiseReport:
    """Train `spec` in reproducible="any-world" on 1 rank and on `spec.nproc`; compare bit for bit.
    A chunking the mode refuses (world size, global batch) raises its paragraph before any rank starts.

    `runner(fn, world, args)` -> the ranks' results in rank order (default: `ddpkit.spawn`, fresh
    processes of one thread each); tests pass their rank pools."""
    invariant.AnyWorld(chunk, rank=0, world_size=spec.nproc).chunks_of(spec.batch_size)
    head = (
        f"ddpkit verify --bitwise: reproducible='any-world', chunk {chunk}, global batch "
        f"{spec.batch_size}, 1 vs {spec.nproc} rank(s), {spec.steps} step(s)"
    )
    try:
        invariant.check_model(build_model(spec))
    except DdpkitError as err:
        return BitwiseReport(
            False, [head, f"refused: {err}", "verdict: FAIL (not world-size invariant)"], first=str(err)
        )
    run = runner or (lambda fn, n, args: ddpkit.spawn(fn, n, args, timeout=spec.timeout, threads=1))
    runs = [run(bitwise_rank, n, (spec, chunk)) for n in (1, spec.nproc)]
    one, many = ([pickle.loads(r) for r in ranks] for ranks in runs)
    return compare(one[0], many, head)


def compare(one: Trace, many: list[Trace], head: str) -> BitwiseReport:
    """The first difference between the 1-rank trace and the N ranks' (merged by global chunk)."""
    lines = [head]
    split = [w for t in many for w in t.weights]
    replicas = all(t.weights == many[0].weights for t in many)
    lines.append(f"replicas on {len(many)} ranks: " + ("bitwise identical" if replicas else "DIFFER"))
    outputs: dict[Key, tuple[str, str, str]] = {}
    for t in many:
        outputs.update(t.outputs)
    first = _first_difference(one, many[0], outputs)
    steps = len(one.weights)
    tensors = len(one.weights[0]) if one.weights else 0
    if first is None and replicas and split:
        lines.append(f"weights after every step: bitwise equal ({tensors} tensors x {steps} steps)")
        lines.append(f"final weights: {_digest_of(one.weights[-1])} on 1 rank and on {len(many)}")
        lines.append("verdict: PASS (world-size invariant)")
        return BitwiseReport(True, lines)
    lines.append(f"first difference: {first or 'between the replicas'}")
    lines.append("verdict: FAIL (not world-size invariant)")
    return BitwiseReport(False, lines, first=first or "replicas")


def _digest_of(weights: dict[str, str]) -> str:
    return hashlib.blake2b("".join(weights.values()).encode(), digest_size=8).hexdigest()


def _first_difference(one: Trace, rank0: Trace, outputs: dict[Key, tuple[str, str, str]]) -> str | None:
    for step in range(len(one.weights)):
        for key in sorted(k for k in one.outputs if k[0] == step):
            name, kind, digest = one.outputs[key]
            if outputs.get(key, (None, None, None))[2] != digest:
                return (
                    f"step {step + 1}, global chunk {key[1]}: the output of module `{name}` ({kind}), "
                    f"call {key[2] + 1} of that chunk's forward; the modules before it agree, so this "
                    "operation depends on more than its chunk (its own generator, the rank, "
                    "a collective)"
                )
        for name, digest in one.grads[step].items():
            if rank0.grads[step].get(name) != digest:
                return (
                    f"step {step + 1}: the combined gradient of `{name}` (every module output "
                    "agrees: its backward is not a function of the chunk alone)"
                )
        for name, digest in one.weights[step].items():
            if rank0.weights[step].get(name) != digest:
                return (
                    f"step {step + 1}: `{name}` after the step (outputs and gradients agree: the "
                    "optimizer step, or a buffer updated per rank)"
                )
    return None
