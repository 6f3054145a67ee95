"""The spike guard's own gradient norm (`SpikeGuard` without `max_norm`): the clip's norm without the clip.

    norm = grad_norm(params)   # Stepper.step under spike_guard= and no max_norm (`ddpkit.step.spikes`)

Under DDP the gradients are views into a few flat all-reduce buckets, so the norm is taken over each run
of gradients lying end to end in one bucket as one flat tensor: one kernel per run instead of one per
parameter plus `get_total_norm`'s own overhead (the measurements are in `ddpkit.step.spikes`'s docstring).
The runs are remembered from step to step (`_Runs`) and let go with the model.
"""

from __future__ import annotations

import math
import operator
import weakref

import torch
from torch import nn

_GRAD = operator.attrgetter("grad")


def grad_norm(params: list[nn.Parameter], _bound: float = math.inf) -> torch.Tensor:
    """The total gradient norm for the guard without `max_norm`, the clip's norm without the clip (its
    multiply of every gradient by 1 cost more than the norm). Under DDP the gradients are views into a few
    flat all-reduce buckets (ddpkit sets `gradient_as_bucket_view=True`): the norm is taken over each run of
    gradients lying end to end in one bucket as one flat tensor (`_Runs`), one kernel per bucket instead of
    one per parameter plus `get_total_norm`'s own overhead; the same value as torch's `get_total_norm` but
    for float rounding (the squares summed in another order), and the same bits on every rank (the
    buckets' layout and contents are). Otherwise (one process, FSDP's DTensor shards,
    `gradient_as_bucket_view=False`): torch's `get_total_norm`, the clip's bits; under FSDP its shards'
    norms combined by `full_tensor`, the one all-reduce a clip costs. Gradients on several meshes (tensor
    parallelism: the split weights on the data x tensor mesh, the whole ones on the data mesh, which
    torch's foreach norm cannot mix): the clip's grouped norm (`by_mesh`)."""
    parts = _RUNS.views(params)
    if parts is None:
        return by_mesh([g for g in map(_GRAD, params) if g is not None])
    # no torch.no_grad() (a context costs as much as the kernel here): plain gradients record no graph;
    # a create_graph=True backward's do, so they take torch's path
    if len(parts) == 1 and not parts[0].requires_grad:
        return torch.linalg.vector_norm(parts[0])
    return nn.utils.get_total_norm(parts)


def by_mesh(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of gradients grouped by their DTensor mesh (plain tensors: one group), as the clip of
    FSDP and TP computes it (`ddpkit.strategy.fsdp.total_norm`, the same ops in the same order: the same
    bits): each group's norm made whole over its mesh (`full_tensor`: replicated dimensions counted
    once), then sqrt of the sum of their squares in float64."""
    groups: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault(getattr(g, "device_mesh", None), []).append(g)
    norms = []
    for group in groups.values():
        norm = nn.utils.get_total_norm(group)
        full = getattr(norm, "full_tensor", None)  # a DTensor: the shards' norms combined
        norms.append(full() if full is not None else norm)
    if len(norms) == 1:
        return norms[0]
    if not norms:
        return torch.zeros(())
    return torch.stack([n.double() for n in norms]).pow(2).sum().sqrt().to(norms[0].dtype)


class _Runs:
    """The flat views of the runs of gradients lying end to end in one storage (DDP's bucket views),
    remembered from step to step.

    Finding the runs costs a few microseconds per gradient (its storage, offset and neighbours) and making
    a view about as much as the norm itself; DDP keeps the same gradient tensors at the same places from
    one step to the next once its buckets are rebuilt (after the first step), so the runs are found again
    only when a parameter's `.grad` is another tensor than the one they were found in (checked in C:
    `map`, no Python loop per parameter) or a run's first gradient moved. The gradients and views are
    held until then, or until one of the parameters is freed (a weak reference's callback): a model
    dropped by the user takes its buckets with it, as without the guard."""

    def __init__(self) -> None:
        self.slots: list[torch.Tensor | None] = []  # each parameter's `.grad` when the runs were found
        self.anchors: list[torch.Tensor] = []  # each run's first gradient
        self.at: list[int] = []  # and its address
        self.parts: list[torch.Tensor] | None = None
        self.watch: list[weakref.ref[nn.Parameter]] = []  # the parameters: one freed, all is let go

    def views(self, params: list[nn.Parameter]) -> list[torch.Tensor] | None:
        """Tensors covering exactly the elements of the parameters' gradients, a run as one flat view (a
        gradient alone where it has no neighbour); None where no two of them share a run (nothing to
        gain) or any is not a plain contiguous tensor (FSDP's DTensors, sparse gradients)."""
        parts, slots = self.parts, self.slots
        same = len(params) == len(slots) and all(map(operator.is_, map(_GRAD, params), slots))
        if parts is not None and same and list(map(torch.Tensor.data_ptr, self.anchors)) == self.at:
            return parts
        self.forget()
        slots = list(map(_GRAD, params))
        grads = [g for g in slots if g is not None]
        runs = _find_runs(grads)
        if runs is None:
            return None
        self.parts = [_flat(grads[first], n) for first, n in runs]
        self.slots, self.anchors = slots, [grads[first] for first, _ in runs]
        self.at = [g.data_ptr() for g in self.anchors]
        self.watch = [weakref.ref(p, self.forget) for p in params]
        return self.parts

    def forget(self, _gone: object = None) -> None:
        self.slots, self.anchors, self.at, self.parts, self.watch = [], [], [], None, []


def _find_runs(grads: list[torch.Tensor]) -> list[tuple[int, int]] | None:
    """The maximal runs of `grads` lying end to end in one storage, in address order, as (index of the
    run's first gradient, elements); None if there is no run of two or more, a gradient is not a plain
    contiguous tensor, or none is a view (gradients autograd allocated one by one: nothing to find, and
    the walk below would cost a microsecond or two per gradient and step)."""
    if not any(type(g) is torch.Tensor and g._is_view() for g in grads):
        return None
    if any(type(g) is not torch.Tensor or g.is_sparse or not g.is_contiguous() for g in grads):
        return None
    order = sorted(range(len(grads)), key=lambda i: grads[i].data_ptr())
    runs: list[tuple[int, int]] = []
    end, prev = -1, grads[0]
    for i in order:
        g = grads[i]
        if runs and g.data_ptr() == end and _same_buffer(prev, g):
            runs[-1] = (runs[-1][0], runs[-1][1] + g.numel())
        else:
            runs.append((i, g.numel()))
        end, prev = g.data_ptr() + g.numel() * g.element_size(), g
    return runs if len(runs) < len(grads) else None


def _flat(first: torch.Tensor, n: int) -> torch.Tensor:
    """The `n` elements from `first`'s on, in its storage, as one flat tensor (`first` itself if alone);
    a run out of the storage's bounds raises here (`set_` checks), it never reads memory it does not own."""
    if first.numel() == n:
        return first
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (n,), (1,))


def _same_buffer(a: torch.Tensor, b: torch.Tensor) -> bool:
    """`a` and `b` can be read as one flat tensor: one storage (not two allocations that happen to touch),
    one dtype, one device."""
    return (
        a.dtype == b.dtype
        and a.device == b.device
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    )


_RUNS = _Runs()  # the process's one training step at a time (`Stepper.step` calls `grad_norm`)
