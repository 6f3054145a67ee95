"""The gradient exchange of a sharded step on CPU ranks of one machine, ZeRO-2 style: a reduce-scatter.

    s.model(net)          # a DDP model on CPU ranks of one machine (`attach` notes it)
    ...
    s.step(opt)           # from the second step on: reduce-scatter, clip on shards, update, all-gather

Why: with the sharded step (`ddpkit.step.sharding`) rank r updates only the parameters it owns, yet
DDP's all-reduce hands every rank the averaged gradients of all parameters, and the step then sets
aside those it does not own. On CPU ranks of one machine the exchange, not the compute, sets the step
(the 37.8M-parameter MLP: 151 MB of gradients per ~70 ms of compute; docs/performance.md section 8).
Here each rank sums only its share: DDP's backward leaves the buckets as they are (`defer_hook`, a
communication hook that does nothing), and `s.step` streams every rank's gradients through ddpkit's
shared-memory slots, each rank adding up only the tensors it owns (`ShmAllReduce.reduce_scatter_mean_`),
before the token rescale, fp16 unscaling and clipping, which then work on shards: the total norm is
agreed by one small all-reduce of the per-tensor norms, the fp16 overflow check by one of the flags.
The update on the share and the publishing of new values are the sharded step's (an all-gather
through the same shared memory).

Exact: an owned gradient is the same division by the world size and the same additions in rank order
as ddpkit's shared-memory all-reduce, so bitwise its result (and, at 2 ranks, bitwise DDP's own
all-reduce: x * 0.5 = x / 2 and a + b = b + a); the total norm is torch's `clip_grad_norm_` formula on
the same per-tensor norms (each computed by its owner, the others' entries zero in a summed vector),
and the clip multiplies the same gradients by the same coefficient (tests/test_shard_exchange.py).

When: only where the sharded step already goes through shared memory, on a DDP model without a
communication hook of the user's, parameters of one floating dtype, contiguous, all in the model. The
first step runs DDP's own all-reduce (the sharded step is decided there, after that backward); the
hook is registered then and takes effect from the next backward. Between `s.backward` and `s.step`
each rank's `.grad` then holds its own, unreduced gradient: read gradients after the exchange, i.e.
clip with `s.step(opt, max_norm=...)`, not by hand. That is why it is asked for, never automatic:
`ddpkit.session(shard_optimizer="gradients")` (the session's Stepper then keeps its DDP models as the
`candidates` a sharded step may `claim`, for that session only); without it
the sharded step keeps DDP's all-reduce and `.grad` holds the averaged gradients as usual.
"""

import weakref  # no `from __future__ import annotations`: DDP compares hook annotations to real types
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


class Deferred:
    """The hook state: whether the last synchronising backward left its buckets unreduced."""

    def __init__(self) -> None:
        self.pending = False


def defer_hook(state: Deferred, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: no communication; the gradients are reduce-scattered in `s.step`."""
    state.pending = True
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


class Candidates:
    """The DDP models of one session whose gradients a sharded step may reduce-scatter (`s.model` adds
    them, found by `parallel.modules.ddp_of`, only for shard_optimizer="gradients"); held weakly, by the
    session's Stepper, so nothing outlives the session. Nothing happens until a sharded step over a
    model's parameters `claim`s it (not when the model has a communication hook of the user's)."""

    def __init__(self) -> None:
        self._models: list[weakref.ref[DistributedDataParallel]] = []

    def add(self, ddp: DistributedDataParallel | None) -> None:
        if ddp is not None:
            self._models = [r for r in self._models if r() is not None] + [weakref.ref(ddp)]

    def newest_first(self) -> list[DistributedDataParallel]:
        return [m for m in (r() for r in reversed(self._models)) if m is not None]


class ScatteredGradients:
    """A sharded step's gradient exchange: the reduce-scatter, and clipping and overflow checks on shards."""

    def __init__(self, shm: Any, group: Any, params: list[torch.Tensor], owners: list[int]) -> None:
        self.shm = shm  # the sharded step's ShmAllReduce
        self.group = group
        self.rank = dist.get_rank(group)
        self.params = params
        self.owners = owners
        self.state = Deferred()
        self.scattered = False  # this step's gradients were reduce-scattered: each rank's share only
        self.steps = 0  # steps whose gradients were reduce-scattered (tests check it is active)

    def reduce(self) -> None:
        """At `s.step`, before anything reads the gradients: reduce each rank's share (when the
        backward deferred it; the first step's backward, before the hook existed, all-reduced)."""
        self.scattered = self.state.pending
        if not self.scattered:
            return
        self.state.pending = False
        pairs = [(p.grad, o) for p, o in zip(self.params, self.owners, strict=True) if p.grad is not None]
        with torch.no_grad():
            self.shm.reduce_scatter_mean_([g for g, _ in pairs], [o for _, o in pairs])
        self.steps += 1

    def clip(self, params: list[Any], max_norm: float, whole: Callable[..., torch.Tensor]) -> torch.Tensor:
        """`clip_grad_norm_(params, max_norm)` on shards: each rank computes the norms of its tensors,
        one all-reduce sums the vector of per-tensor norms (one non-zero entry each), and every rank
        takes torch's total norm of it and clips its own gradients. `whole` when not scattered."""
        if not self.scattered:
            return whole(params, max_norm)
        owner = {id(p): o for p, o in zip(self.params, self.owners, strict=True)}
        with_grad = [p for p in params if p.grad is not None]
        if not with_grad:
            return torch.tensor(0.0)
        mine = [i for i, p in enumerate(with_grad) if owner.get(id(p), -1) == self.rank]
        norms = torch.zeros(len(with_grad), dtype=with_grad[0].grad.dtype)
        if mine:
            own = torch._foreach_norm([with_grad[i].grad for i in mine], 2.0)
            norms[mine] = torch.stack(own)
        dist.all_reduce(norms, group=self.group)  # x + 0 + ... = x: exact whatever the order
        total = torch.linalg.vector_norm(norms, 2.0)
        nn.utils.clip_grads_with_norm_([with_grad[i] for i in mine], max_norm, total)
        return total

    def agree_found_inf(self, flags: list[torch.Tensor]) -> None:
        """fp16: after unscaling, the overflow flags (from `precision.LossScale`, their owner) agreed by
        every rank (max over ranks). A non-finite sum has a non-finite term on some rank, seen there in
        its share or its own gradients, so the max is the flag the all-reduced gradients would have
        given everywhere."""
        if not self.scattered:
            return
        for flag in flags:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)


def claim(
    shm: Any, group: Any, params: list[torch.Tensor], owners: list[int], candidates: Candidates | None
) -> ScatteredGradients | None:
    """The exchange for a sharded step over `params` (`owners[i]` updates `params[i]`), with the defer
    hook registered on the attached DDP model holding them; None when the step keeps DDP's all-reduce.
    Every rank decides alike: the same model, parameters and environment everywhere."""
    if shm is None or candidates is None:
        return None
    trained = {id(p) for p in params if p.requires_grad}
    dtypes = {p.dtype for p in params}
    if len(dtypes) != 1 or next(iter(dtypes)) not in _FLOATS:
        return None
    if not all(p.device.type == "cpu" and p.is_contiguous() for p in params):
        return None
    for ddp in candidates.newest_first():
        if getattr(ddp, "_comm_hooks", None):
            continue
        # all the model's trained parameters: none left unreduced for another optimizer
        if trained == {id(p) for p in ddp.parameters() if p.requires_grad}:
            exchange = ScatteredGradients(shm, group, params, owners)
            ddp.register_comm_hook(exchange.state, defer_hook)
            return exchange
    return None
