"""World-size-invariant training: the same weights, bit for bit, on 1, 2, 4, ... ranks.

    with ddpkit.session(reproducible="any-world", chunk=4, seed=0) as s:
        model = s.model(net)                           # BatchNorm: refused at the first step (batch-wide)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for x, y in s.loader(data, batch_size=32, shuffle=True):   # rank r: chunks r*C/W..(r+1)*C/W-1
            loss = s.invariant.step(model, opt, (x, y), lambda m, b: F.cross_entropy(m(b[0]), b[1]))

Why DDP is not bitwise the same at another world size: one process sums the 32 per-sample gradients
inside one kernel, two ranks sum 16 each and add the halves in the all-reduce; the kernels block
differently for 16 and 32 rows, so the additions happen in another order and the last bits differ
(then AdamW magnifies them). This mode fixes every order that depends on the world size:

1. The global batch is C chunks of `chunk` samples (C a power of two); rank r of W (a power of two
   dividing C) holds the contiguous chunks r*C/W .. (r+1)*C/W - 1 of the order one process reads
   (`global_order` + the loader's shared-order split).
2. Each chunk runs forward and backward on its own, with the same shapes at every world size, so the
   same kernels; its random draws (dropout) come from a generator seeded by (seed, step, global chunk).
3. The chunks' gradients (and losses) are summed pairwise in a fixed binary tree over the global chunk
   index (`ddpkit.step.chunktree`): within a rank, then across ranks. Each rank's partial sum is a node
   of the tree; rank j receives the j-th slice of every rank's partial sum (one all-to-all), pairs them
   in rank order, and the summed slices are all-gathered: every element is added in the tree's order
   (addition is element-wise, so slicing changes no bit), over any process group and across machines,
   with about two gradient buffers per rank instead of W. DDP's all-reduce is never used (the inner
   module runs the chunks); `guard` makes a backward through the DDP wrapper an error, so a loop
   written for DDP (`loss.backward()`, `s.backward`) cannot silently train a world-size-dependent run.
4. One normalisation: each chunk's mean loss times 1/C before its backward (a power of two, so exact:
   the same bits as scaling the sum afterwards, without a pass over it), so the tree sums to the mean.
5. `torch.use_deterministic_algorithms(True)` during the step; then clipping and the optimizer act on
   identical gradients on every rank.

Limits (each refused with a paragraph): `s.backward`/`s.step`/`fit` or a plain `loss.backward()`
through the DDP model (step with `s.invariant.step`), BatchNorm (its statistics span the chunk, and its
running statistics would be updated per rank), world sizes that are not a power of two or do not divide
C, fp16 (its loss scale). Not offered: token-weighted losses (the mode normalises by the global number
of chunks, so `loss_fn` returns each chunk's mean). The intra-op thread count must be the same in the
runs compared (a kernel splits its sums by threads). Its price: the chunks run one after the other in
small kernels; see docs/equivalence.md ("World-size-invariant training").
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import IterableDataset, RandomSampler, Sampler, SequentialSampler

from ddpkit.errors import problem
from ddpkit.step.chunktree import TreeSum, combine, is_power_of_two

MODES = (None, "any-world")
LossFn = Callable[[nn.Module, Any], torch.Tensor]


@dataclass
class Counters:
    """What the mode did: proof in a test that it ran, not DDP (`chunks` = steps x C/W)."""

    steps: int = 0
    chunks: int = 0
    gathers: int = 0
    peak_buffers: int = 0


def configure(
    reproducible: str | None,
    chunk: int | None,
    *,
    seed: int = 0,
    precision: Any = None,
    accumulation: int = 1,
    group: Any = None,
    rank: int | None = None,
    world_size: int | None = None,
    phases: Phases | None = None,
) -> AnyWorld | None:
    """The session's option: None (normal DDP) or "any-world" with a chunk size (see the docstring).
    `precision`: the session's `PrecisionPlan` (its autocast runs each chunk's forward; fp16 refused)."""
    if reproducible not in MODES:
        raise problem(
            f"reproducible={reproducible!r} is not a mode ddpkit knows",
            "Pass reproducible='any-world' (with chunk=, e.g. 4) or leave it out",
        )
    if reproducible is None:
        if chunk is not None:
            raise problem(
                f"chunk={chunk} was given without reproducible='any-world'",
                "Pass reproducible='any-world' too, or leave chunk out",
            )
        return None
    name = getattr(precision, "name", precision or "32")
    if name in ("16", "fp16", "16-mixed"):
        raise problem(
            "reproducible='any-world' with fp16: the loss scale and its skipped steps are "
            "not part of the fixed tree",
            "Use precision='32' or 'bf16'",
        )
    if accumulation != 1:
        raise problem(
            f"reproducible='any-world' with accumulation={accumulation}: the mode already runs the global "
            "batch as chunks, one after the other",
            "Leave accumulation out (1); a larger global batch costs memory only per chunk",
        )
    context = getattr(precision, "forward_context", None)
    return AnyWorld(
        chunk if chunk is not None else 4,
        seed=seed,
        group=group,
        rank=rank,
        world_size=world_size,
        forward_context=context,
        phases=phases,
    )


def check_model(module: nn.Module) -> None:
    """Refuse the layers whose result depends on which samples share a forward (batch-wide ops)."""
    for name, sub in module.named_modules():
        if isinstance(sub, nn.modules.batchnorm._BatchNorm):
            raise problem(
                f"{name or 'the model'} is a {type(sub).__name__}: its statistics span every sample of a "
                "forward, so with reproducible='any-world' each chunk would be normalised by its own "
                "statistics (a different model than one batch) and its running statistics would be "
                "updated by each rank's chunks only, so the replicas would drift apart",
                "Use a per-sample normalisation (LayerNorm, GroupNorm), or train without "
                "reproducible='any-world' (with sync_batchnorm=True)",
            )


def global_order(dataset: Any, shuffle: bool) -> Sampler:
    """The sampler one process would read: the loader draws it seeded by (seed, epoch) on every rank
    and gives rank r the r-th contiguous share of each global batch (`SharedOrderSampler`)."""
    return RandomSampler(dataset) if shuffle else SequentialSampler(dataset)


class Phases(Protocol):
    """Where a step's time goes (the session's `observe.anatomy.StepAnatomy`): `mark(phase)` when a phase
    ends, `stepped(applied)` after the optimizer. Duck-typed, so the step wing does not import observe."""

    def mark(self, phase: str) -> None: ...

    def stepped(self, applied: bool) -> None: ...


class _NoPhases:
    def mark(self, phase: str) -> None:
        pass

    def stepped(self, applied: bool) -> None:
        pass


class AnyWorld:
    """The mode's state for one session: the chunk size, the ranks, the step counter."""

    def __init__(
        self,
        chunk: int,
        *,
        seed: int = 0,
        group: Any = None,
        rank: int | None = None,
        world_size: int | None = None,
        forward_context: Callable[[], contextlib.AbstractContextManager] | None = None,
        phases: Phases | None = None,
    ) -> None:
        """`rank`/`world_size`: given by a session before it joins the group; else read from `group`.
        `phases`: the session's step anatomy, so `StepMonitor`, MFU and the slow rank see these steps too."""
        if not isinstance(chunk, int) or chunk < 1:
            raise problem(f"chunk={chunk!r} is not a positive number of samples", "Pass e.g. chunk=4")
        self.chunk, self.seed, self.group = chunk, seed, group
        self.forward_context = forward_context or contextlib.nullcontext
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = rank if rank is not None else dist.get_rank(group) if distributed else 0
        self.world = (
            world_size if world_size is not None else dist.get_world_size(group) if distributed else 1
        )
        if not is_power_of_two(self.world):
            raise problem(
                f"reproducible='any-world' on {self.world} ranks: the ranks' partial sums are nodes of a "
                "binary tree only when the world size is a power of two",
                "Run on 1, 2, 4, 8, ... ranks",
            )
        self.counters = Counters()
        self.phases: Phases = phases or _NoPhases()

    # -- checkpoints: s.save(..., invariant=s.invariant) -------------------------------------------
    def state_dict(self) -> dict[str, int]:
        """The step counter (it seeds each chunk's draws) and the chunking a resumed run must keep."""
        return {"steps": self.counters.steps, "chunk": self.chunk, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if (state["chunk"], state["seed"]) != (self.chunk, self.seed):
            raise problem(
                f"the checkpoint was trained with chunk={state['chunk']}, seed={state['seed']}; this session "
                f"has chunk={self.chunk}, seed={self.seed}, so the chunks and their draws would differ",
                f"Resume with ddpkit.session(reproducible='any-world', chunk={state['chunk']}, "
                f"seed={state['seed']})",
            )
        self.counters.steps = state["steps"]

    # -- data ------------------------------------------------------------------------------------
    def chunks_of(self, global_batch: int) -> int:
        """C for a global batch, checked: a whole power-of-two number of chunks that W divides."""
        count, rest = divmod(global_batch, self.chunk)
        if rest or not is_power_of_two(count):
            good = self.chunk * 2 ** max(global_batch // self.chunk, 1).bit_length()
            raise problem(
                f"global batch {global_batch} is not a power-of-two number of chunks of {self.chunk} "
                "samples, so the chunks' sums cannot form one balanced tree",
                f"Use a global batch of {self.chunk} x 2^k samples (e.g. {good // 2 or self.chunk}), or "
                "another chunk=",
            )
        if count % self.world:
            raise problem(
                f"global batch {global_batch} holds {count} chunk(s) of {self.chunk}, which {self.world} "
                "ranks cannot share as contiguous equal ranges",
                f"Use a global batch of at least {self.chunk * self.world} samples, or a smaller chunk=",
            )
        return count

    def loader_options(
        self, dataset: Any, batch_size: int | None, shuffle: bool, options: dict[str, Any]
    ) -> tuple[bool, bool]:
        """`s.loader`'s (shuffle, drop_last) in this mode, `options` (its DataLoader keywords) completed in
        place: a map-style source read in the global order one process reads (`global_order` as
        `sampler=`, which the loader cuts into contiguous shares); an iterable source is already split
        that way; whole global batches only."""
        if batch_size is None:
            raise problem(
                "reproducible='any-world' needs the global batch_size= in s.loader",
                "Pass batch_size= (the global batch, chunk x 2^k samples)",
            )
        self.chunks_of(batch_size)
        own = options.get("sampler") is not None or options.get("batch_sampler") is not None
        if own or isinstance(dataset, IterableDataset) or not hasattr(dataset, "__getitem__"):
            return shuffle, True
        options["sampler"] = global_order(dataset, shuffle)
        return False, True

    # -- the step ----------------------------------------------------------------------------------
    def step(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        batch: Any,
        loss_fn: LossFn,
        *,
        max_norm: float | None = None,
        inspect: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """One optimizer step on this rank's share of the global batch; returns the global mean loss.

        `loss_fn(module, chunk)` returns the MEAN loss over the chunk's samples; `batch` is this rank's
        share (a tensor, or a tuple/list/dict of tensors, samples along dim 0). `inspect()` is called
        once the combined gradients are in `.grad`, before clipping and the optimizer (verify reads them).
        """
        module = _inner(model)
        check_model(module)
        params = [p for p in module.parameters() if p.requires_grad]
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise problem(
                f"trainable parameters of several dtypes ({sorted(map(str, dtypes))})",
                "Train one parameter dtype in reproducible='any-world'",
            )
        samples = _length(batch)
        local, rest = divmod(samples, self.chunk)
        if rest or not is_power_of_two(local):
            raise problem(
                f"this rank's batch of {samples} samples is not a power-of-two number of chunks of "
                f"{self.chunk}",
                "Build the loader with s.loader(..., batch_size=chunk x 2^k) in this mode",
            )
        tree = TreeSum()
        with _deterministic(params[0].is_cuda if params else False):
            for j in range(local):
                index = self.rank * local + j  # the global chunk index
                part = _slice(batch, j * self.chunk, (j + 1) * self.chunk)
                tree.add(self._chunk_grad(module, params, part, loss_fn, index, 1.0 / (local * self.world)))
        total = self._across_ranks(tree.total(), local)
        _write_grads(params, total)
        self.phases.mark("sync")  # the cross-rank combine, and the sums written into .grad
        if inspect is not None:
            inspect()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.phases.stepped(True)
        self.counters.steps += 1
        self.counters.chunks += local
        self.counters.peak_buffers = max(self.counters.peak_buffers, tree.peak_buffers)
        return total[-3].clone()

    def _chunk_grad(
        self,
        module: nn.Module,
        params: Sequence[nn.Parameter],
        part: Any,
        loss_fn: LossFn,
        index: int,
        scale: float,
    ) -> torch.Tensor:
        """One chunk's gradients, its loss and a free slot in one fresh flat buffer (draws seeded)."""
        for p in params:
            p.grad = None
        devices = [torch.cuda.current_device()] if params and params[0].is_cuda else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(_chunk_seed(self.seed, self.counters.steps, index))
            with self.forward_context():
                loss = loss_fn(module, part)
            self.phases.mark("forward")  # each chunk's forward and backward add to the step's phases
            if loss.dim() != 0:
                raise problem(
                    f"loss_fn returned a tensor of shape {tuple(loss.shape)}, not a scalar",
                    "Return the mean loss over the chunk's samples",
                )
            (loss * scale).backward()  # 1/C, a power of two: exact, and no pass over the sum afterwards
            self.phases.mark("backward")
        flat = [p.grad.reshape(-1) if p.grad is not None else torch.zeros_like(p).reshape(-1) for p in params]
        flat.append((loss.detach() * scale).to(params[0].dtype).reshape(1))
        flat.append(torch.zeros(2, dtype=params[0].dtype, device=params[0].device))  # the counts' slots
        return torch.cat(flat)

    def _across_ranks(self, partial: torch.Tensor, local: int) -> torch.Tensor:
        """All ranks' subtree sums, then the tree's top levels, identically on every rank: a reduce-scatter
        by slices (one all-to-all; rank j pairs the j-th slices in rank order) and an all-gather of the
        summed slices. The buffer's last two slots (sums of zeros) carry this rank's chunk count n and
        n * n: every rank then reads the same totals, and W * sum(n * n) == sum(n) ** 2 only when every
        rank holds as many chunks, so they agree to go on or to refuse."""
        partial[-2], partial[-1] = float(local), float(local * local)
        if self.world == 1:
            return partial
        size = partial.numel()
        width = -(-size // self.world)  # each rank sums one slice of the buffer
        padded = torch.zeros(width * self.world, dtype=partial.dtype, device=partial.device)
        padded[:size] = partial
        del partial
        slices = torch.empty_like(padded)  # row r: rank r's partial sum over this rank's slice
        dist.all_to_all_single(slices, padded, group=self.group)
        mine = combine(list(slices.view(self.world, width)), fresh=True)
        dist.all_gather(list(padded.view(self.world, width)), mine, group=self.group)
        del slices, mine
        self.counters.gathers += 1
        counts, squares = padded[size - 2].item(), padded[size - 1].item()
        if self.world * squares != counts * counts:
            raise problem(
                f"the ranks hold different numbers of chunks this step ({int(counts)} in all over "
                f"{self.world} ranks, {local} here)",
                "Give every rank the same share: s.loader(..., batch_size=global) in this mode",
            )
        return padded[:size]

    def guard(self, ddp: nn.parallel.DistributedDataParallel | None) -> None:
        """Make DDP's all-reduce an error for a model `s.model` wrapped: in this mode the gradients are
        summed by `step` in the fixed tree, so a backward through the wrapper (`loss.backward()` after
        `model(x)`, `s.backward`) would train an ordinary, world-size-dependent run without a word."""
        if ddp is None:
            return

        def refuse(state, bucket):  # unannotated: DDP checks the annotations, and they are strings here
            raise problem(
                "a backward ran through the DDP model in a session with reproducible='any-world': DDP's "
                "all-reduce sums the gradients in its own order, so the weights would depend on the "
                "world size again",
                "Step with loss = s.invariant.step(model, opt, batch, loss_fn) (loss_fn(module, chunk) "
                "returns the chunk's mean loss) instead of loss.backward() / s.backward / s.step / fit",
            )

        ddp.register_comm_hook(None, refuse)


def _inner(model: nn.Module) -> nn.Module:
    """The module itself: DDP's wrapper is bypassed (its all-reduce would sum in its own order)."""
    if type(model).__name__ in ("FullyShardedDataParallel", "FSDPModule") or hasattr(model, "reshard"):
        raise problem(
            "reproducible='any-world' with FSDP: the sharded gradients are reduce-scattered in FSDP's order",
            "Use strategy='ddp' (or 'single') in this mode",
        )
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def _chunk_seed(seed: int, step: int, index: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{step}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


@contextlib.contextmanager
def _deterministic(cuda: bool) -> Iterator[None]:
    if cuda and os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in (":4096:8", ":16:8"):
        raise problem(
            "reproducible='any-world' on CUDA needs cuBLAS's deterministic workspace, and "
            f"CUBLAS_WORKSPACE_CONFIG is {os.environ.get('CUBLAS_WORKSPACE_CONFIG')!r}",
            "Start the ranks with CUBLAS_WORKSPACE_CONFIG=:4096:8 in their environment",
        )
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def _length(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    values = list(batch.values()) if isinstance(batch, dict) else list(batch)
    lengths = {_length(v) for v in values}
    if len(lengths) != 1:
        raise problem(
            f"the batch's tensors hold different numbers of samples ({sorted(lengths)})",
            "Put the samples along dim 0 of every tensor",
        )
    return lengths.pop()


def _slice(batch: Any, start: int, stop: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[start:stop]
    if isinstance(batch, dict):
        return {k: _slice(v, start, stop) for k, v in batch.items()}
    return type(batch)(_slice(v, start, stop) for v in batch)


def _write_grads(params: Sequence[nn.Parameter], total: torch.Tensor) -> None:
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = total[offset : offset + n].view_as(p)  # views of one buffer: no copy
        offset += n
