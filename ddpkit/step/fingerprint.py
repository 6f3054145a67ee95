"""Replica fingerprints: every N steps, do the replicas still hold bitwise the same weights?

Under DDP (and across HSDP's replicas) every replica must hold the same bits after every step. A
rank-dependent operation, a non-deterministic kernel or a device that computes wrongly makes one replica
part from the others without an error. So, every `every` optimizer steps:

    h[i]  = the sum of tensor i's bits read as int64 words (a one-bit flip moves it by 2^k, never 0)
    f     = sum_i h[i] * (2i + 1)                 (int64, wrapping: one number per replica)
    max(f), max(~f) over the replicas             (one all-reduce of two int64: max(~f) = ~min(f))
    min == max: they agree; else every rank sees it at the same step, gathers the h of every replica
    (a second, rare collective) and stops with the ranks that differ, the first tensor by its name in
    the user's model, and the last step at which they agreed.

Under HSDP each shard has its own replica group; the all-reduce runs over every rank with one pair of
slots per group (keyed by the group's lowest rank), so a drift in one group stops every rank at the
same step, not only that group's (the others would wait in their next collective).

The tensors are the model's parameters and buffers and the optimizer's state, as each rank holds them:
under HSDP a rank's local shards, compared over the replicate dimension only (the ranks holding the
same shard); FSDP alone holds one replica (each rank a different shard), so there is nothing to
compare; under DDP every rank is a replica.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.errors import DdpkitError, problem

# The session's default (`fingerprint_every=`): measured (benchmarks/fingerprint_cost.py, 2 gloo ranks)
# the check costs 0.74% (gpt) to 8.9% (mlp with a replicated AdamW state) of one step; every 100 steps,
# 0.007% to 0.09%, and a drift is caught within 100 steps.
FINGERPRINT_EVERY = 100

_UNUSED = -(2**63)  # a verdict slot no replica group wrote (a group's pair is never both this: ~f != f)
_INT = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


class ReplicaDrift(DdpkitError):
    """The replicas no longer hold the same weights; raised on every rank at the same step.

    `step`: the optimizer step of the check that saw it; `last_agreed`: the last step checked at which
    the replicas agreed (None: no check before); `ranks`: the ranks that differ from the majority (empty
    when none is a majority); `tensor`: the first tensor that differs, by its name in the user's model."""

    def __init__(
        self,
        message: str,
        *,
        step: int = 0,
        last_agreed: int | None = None,
        ranks: tuple[int, ...] = (),
        tensor: str = "",
    ) -> None:
        super().__init__(message)
        self.step, self.last_agreed, self.ranks, self.tensor = step, last_agreed, ranks, tensor


def tensor_hash(t: torch.Tensor) -> torch.Tensor:
    """The sum of the tensor's bits read as int64 words, wrapping (a 0-dim int64 tensor on its device).

    A one-bit flip moves the sum by +-2^k (mod 2^64), never by 0. Read as 64-bit words, the sum is one
    pass in the integer type itself (measured: 9 ms for 16M floats on one core, against 237 ms when
    each 32-bit value is first widened to int64); a tensor whose bytes do not fill whole words is
    widened element by element instead."""
    t = t.detach()
    if hasattr(t, "to_local"):  # a DTensor: this rank's shard
        t = t.to_local()
    flat = t.contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.int8)
    if (flat.numel() * flat.element_size()) % 8 == 0 and flat.numel() > 0:
        return flat.view(torch.int64).sum()
    if flat.is_floating_point() or flat.is_complex():
        flat = flat.view(_INT[flat.element_size()])
    return flat.sum(dtype=torch.int64)


def named_state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None, names: dict[int, str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors a replica must agree on: parameters, buffers, then the optimizer's state by name.
    `names` (by the parameter's id) overrides the module's own names (`parameter_names`)."""
    names = dict(names or {})
    for name, p in model.named_parameters():
        name = names.setdefault(id(p), name)
        yield name, p
    yield from model.named_buffers()
    if optimizer is None:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in sorted(optimizer.state.get(p, {}).items(), key=lambda kv: str(kv[0])):
                if isinstance(value, torch.Tensor):
                    yield f"optimizer state {names.get(id(p), '?')}.{key}", value


@dataclass(frozen=True)
class Replicas:
    """Which ranks hold copies of this rank's tensors: a process group (None: the default group) and
    its global ranks; `count` 1 when there is nothing to compare, `why` says what the layout is."""

    group: dist.ProcessGroup | None
    ranks: tuple[int, ...]
    why: str

    @property
    def count(self) -> int:
        return len(self.ranks)

    @property
    def slots(self) -> int:
        """Verdict slots in the all-reduce over every rank: one per possible replica group (HSDP: keyed
        by the group's lowest rank), one for DDP's single group."""
        return 1 if self.group is None else dist.get_world_size()

    @property
    def key(self) -> int:
        return 0 if self.group is None else min(self.ranks)


def replicas_of(model: nn.Module) -> Replicas:
    """The replicas of this rank's copy of `model`, read from its parameters: DTensors on a 2-D mesh
    (HSDP: replicate x shard) compare over mesh dimension 0; on a 1-D mesh (FSDP) there is one replica;
    plain tensors in a job of several ranks (DDP) compare over every rank."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return Replicas(None, (0,), "one process: one replica")
    mesh = next((p.device_mesh for p in model.parameters() if hasattr(p, "device_mesh")), None)
    if mesh is None:
        return Replicas(None, tuple(range(dist.get_world_size())), "every rank a replica (DDP)")
    if mesh.ndim == 1:
        return Replicas(None, (dist.get_rank(),), "FSDP holds one replica (each rank a different shard)")
    group = mesh.get_group(0)
    ranks = tuple(dist.get_process_group_ranks(group))
    return Replicas(group, ranks, f"HSDP: {len(ranks)} replicas of this rank's shard (ranks {list(ranks)})")


class ReplicaFingerprints:
    """Compare the replicas' fingerprints every `every` optimizer steps (0: never)."""

    def __init__(self, every: int) -> None:
        if every < 0:
            raise problem(
                f"fingerprint_every={every} is negative", "Pass 0 (off) or a number of steps, e.g. 100"
            )
        self.every = every
        self.last_agreed: int | None = None  # the last step checked at which the replicas agreed
        self.checks = 0

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def after_step(
        self, step: int, model: nn.Module | None, optimizer: torch.optim.Optimizer | None = None
    ) -> bool:
        """Check when `step` is due; True when a check ran (and agreed: a mismatch raises on every rank).

        Pass `optimizer` only when its state is replicated (plain DDP): under the sharded step each rank
        holds the state of its own parameters, which the replicas do not share."""
        if not self.due(step):
            return False
        self.check(step, model, optimizer)
        return True

    def check(
        self, step: int, model: nn.Module | None, optimizer: torch.optim.Optimizer | None = None
    ) -> None:
        """Compare now (every replica calls it at the same step); raise `ReplicaDrift` on a mismatch.
        Without a model (a loop that never ran `s.accumulate`), the optimizer's parameters are compared."""
        holder = None
        if model is None:
            if optimizer is None:
                return
            model = holder = _holder(optimizer)
        replicas = replicas_of(model)
        if replicas.count < 2:
            self.last_agreed = step
            return
        named = list(named_state(_inner(model), optimizer))
        hashes = torch.stack([tensor_hash(t).to(_device(named)) for _, t in named])
        weights = torch.arange(1, 2 * len(named), 2, dtype=torch.int64, device=hashes.device)
        f = (hashes * weights).sum()
        verdicts = torch.full((2 * replicas.slots,), _UNUSED, dtype=torch.int64, device=hashes.device)
        verdicts[2 * replicas.key], verdicts[2 * replicas.key + 1] = f, ~f
        dist.all_reduce(verdicts, op=dist.ReduceOp.MAX)  # every rank learns every replica group's verdict
        self.checks += 1
        pairs = verdicts.view(-1, 2).tolist()
        if all(a == ~b for a, b in pairs if (a, b) != (_UNUSED, _UNUSED)):
            self.last_agreed = step
            return
        if holder is not None and optimizer is not None:  # the names of the model holding the parameters
            named = list(named_state(holder, optimizer, parameter_names(optimizer)))
        rows = _gather(torch.cat([torch.tensor([replicas.key], device=hashes.device), hashes]))
        raise self.drift(step, [n for n, _ in named], rows)

    def drift(self, step: int, names: list[str], rows: list[torch.Tensor]) -> ReplicaDrift:
        """The `ReplicaDrift` every rank raises: `rows[r]` is rank r's [group key, hashes...]; the first
        replica group (by lowest rank) whose replicas differ is explained, the others counted."""
        by_key: dict[int, list[int]] = {}
        for rank, row in enumerate(rows):
            by_key.setdefault(int(row[0]), []).append(rank)
        differ = [
            ranks
            for _, ranks in sorted(by_key.items())
            if len({tuple(rows[r][1:].tolist()) for r in ranks}) > 1
        ]
        ranks = differ[0]
        scope = (
            f" ({len(differ)} of {len(by_key)} replica groups differ; the first is that of ranks {ranks})"
            if len(by_key) > 1
            else ""
        )
        text = self.explain(step, names, tuple(ranks), [rows[r][1:] for r in ranks], scope)
        hashes = [rows[r][1:] for r in ranks]
        groups = _groups(tuple(ranks), hashes)
        odd = tuple(sorted(r for g in groups[1:] for r in g)) if len(groups[0]) > len(groups[1]) else ()
        first = _differing(hashes)
        tensor = names[first[0]] if first else ""
        return ReplicaDrift(text, step=step, last_agreed=self.last_agreed, ranks=odd, tensor=tensor)

    def explain(
        self, step: int, names: list[str], ranks: tuple[int, ...], hashes: list[torch.Tensor], scope: str = ""
    ) -> str:
        """One paragraph: the ranks that differ, the first tensor, and the last step they agreed; `scope`
        says which of several replica groups (HSDP) it is."""
        groups = _groups(ranks, hashes)
        sizes = {h.numel() for h in hashes}
        differ = _differing(hashes)
        first = names[differ[0]] if differ else "(none of the first ones)"
        if len(sizes) > 1:
            first += f"; the replicas hold different numbers of tensors ({sorted(sizes)})"
        if len(groups) > 1 and len(groups[0]) > len(groups[1]):
            odd = sorted(r for g in groups[1:] for r in g)
            who = f"rank(s) {', '.join(map(str, odd))} differ from the {len(groups[0])} others"
        else:
            who = (
                "the replicas split into "
                + " and ".join("ranks {" + ", ".join(map(str, g)) + "}" for g in groups)
                + " (no majority names one)"
            )
        agreed = f"step {self.last_agreed}" if self.last_agreed is not None else "no check before this one"
        return (
            f"the replicas hold different weights at step {step}: {who}; the first tensor that differs is "
            f"{first} ({len(differ)} of {len(names)} tensors differ); they last agreed at {agreed}. A "
            "rank-dependent operation, a non-deterministic kernel or a faulty device changed one "
            f"replica{scope}: every rank stops here. Resume from a checkpoint written at or before the "
            "last agreement (ddpkit.fit rolls back to it by itself: on_drift='rollback'), and run "
            "`ddpkit verify --locate` on the model to find the operation"
        )


def _gather(row: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's row (padded to the longest: the replicas may hold different sets), over every rank:
    only after a mismatch, so one extra collective on a rare path."""
    world = dist.get_world_size()
    size = torch.tensor([row.numel()], dtype=torch.int64, device=row.device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    padded = torch.zeros(int(max(sizes)), dtype=torch.int64, device=row.device)
    padded[: row.numel()] = row
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded)
    return [g[: int(n)].cpu() for g, n in zip(gathered, sizes, strict=True)]


def _differing(hashes: list[torch.Tensor]) -> list[int]:
    """The indices of the tensors whose hashes differ between the replicas (over the tensors all hold:
    an optimizer whose state is sharded, passed as if replicated, gives the replicas different counts)."""
    common = min(h.numel() for h in hashes)
    return [i for i in range(common) if len({int(h[i]) for h in hashes}) > 1]


def _groups(ranks: tuple[int, ...], hashes: list[torch.Tensor]) -> list[list[int]]:
    """The ranks grouped by identical hash vectors, the largest group first (ties: by lowest rank)."""
    by: dict[tuple[int, ...], list[int]] = {}
    for rank, h in zip(ranks, hashes, strict=True):
        by.setdefault(tuple(h.tolist()), []).append(rank)
    return sorted(by.values(), key=lambda g: (-len(g), g[0]))


def parameter_names(optimizer: torch.optim.Optimizer) -> dict[int, str]:
    """The optimizer's parameters' names (by id) in the user's model, for a report when the stepper saw
    no model (a loop without `s.accumulate`): the names the optimizer was built with
    (`AdamW(model.named_parameters())`), else those of the live module that holds the most of them, the
    innermost such module (so no wrapper's prefix). Only after a mismatch: the search walks the
    interpreter's objects once."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    named = {
        id(p): n
        for g in optimizer.param_groups
        for p, n in zip(g["params"], g.get("param_names", ()), strict=False)
    }
    if len(named) == len(params):
        return named
    wanted = {id(p) for p in params}
    best: tuple[int, int, dict[int, str]] | None = None
    seen: set[int] = set()
    for obj in gc.get_objects():
        if not issubclass(type(obj), nn.Module) or isinstance(obj, _Holder):  # type(): no lazy __class__
            continue
        module = _inner(obj)
        if id(module) in seen:
            continue
        seen.add(id(module))
        found = {id(p): n for n, p in module.named_parameters() if id(p) in wanted}
        score = (len(found), -sum(map(len, found.values())))
        if found and (best is None or score > best[:2]):
            best = (*score, found)
    return {**(best[2] if best is not None else {}), **named}


class _Holder(nn.Module):
    """The modules `_holder` builds (never taken for the user's model by `parameter_names`)."""


def _holder(optimizer: torch.optim.Optimizer) -> nn.Module:
    """A module holding the optimizer's parameters as `group<g>.<i>`: their order and layout for a check
    when no model was seen (their names in a report: `parameter_names`)."""
    holder = _Holder()
    for g, group in enumerate(optimizer.param_groups):
        part = _Holder()
        for i, p in enumerate(group["params"]):
            part.register_parameter(str(i), p)
        holder.add_module(f"group{g}", part)
    return holder


def _inner(model: nn.Module) -> nn.Module:
    """The user's module inside DDP and torch.compile's wrappers, so names read as in the user's model."""
    from torch._dynamo.eval_frame import OptimizedModule
    from torch.nn.parallel import DistributedDataParallel

    while isinstance(model, (DistributedDataParallel, OptimizedModule)):
        model = model.module if isinstance(model, DistributedDataParallel) else model._orig_mod
    return model


def _device(named: list[tuple[str, torch.Tensor]]) -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
