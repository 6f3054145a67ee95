"""One training loop for both sides of the check: one process on the global batch, or a DDP rank.

Both sides are written with ddpkit's public API, as a user's script would be: `ddpkit.session(seed)`,
`s.model(...)`, `s.loader(...)` (a DistributedSampler also at world size 1, so the global order of
every epoch is the same at every world size). The single run uses a world-size-1 session. What each
run records is what the comparison and the diagnosis need: weights after every step, the gradients of
the first step, a hash of every batch, and (DDP) which tensors differ between the replicas.
"""

from __future__ import annotations

import contextlib
import hashlib
import pickle
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import ddpkit
from ddpkit.data import plan_batch
from ddpkit.errors import problem
from ddpkit.step import tokens
from ddpkit.verify.calibrate import FeatureSplit
from ddpkit.verify.spec import VerifySpec, build_data, build_loss, build_model, build_optimizer, resolve


@dataclass
class Trajectory:
    """What one run recorded. A DDP rank keeps the weights and gradients on global rank 0 only."""

    rank: int = 0
    world: int = 1
    init_hash: str = ""  # the factory's weights, before s.model
    states: list[dict[str, torch.Tensor]] = field(default_factory=list)  # index 0: before the first step
    params: list[str] = field(default_factory=list)  # which names in `states` are parameters
    grads: dict[str, torch.Tensor | None] = field(default_factory=dict)  # first step, after backward
    step_path: str = ""  # with spec.shard_optimizer: how rank 0's s.step ran (the sharded step's own words)
    losses: list[float] = field(default_factory=list)  # DDP: the mean over ranks
    batch_hashes: list[list[str]] = field(default_factory=list)  # single: every rank's shard; DDP: own
    replica_diff: list[dict[str, float]] = field(default_factory=list)  # per step: name -> spread
    error: str | None = None
    error_step: int | None = None
    batchnorm: list[str] = field(default_factory=list)  # BatchNorm modules that are not synchronised
    dropout: list[str] = field(default_factory=list)  # modules that draw random numbers in forward
    random_forward: bool = False  # forward or loss drew from the global generator in the first step
    graphs_compiled: int = 0  # graphs torch.compile built during this run's steps (compile=True)
    strategy: str = ""  # what ran (the strategy's describe(), e.g. "HSDP (..., replicate 2 x shard 2)")


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns as int64, so that equal bits <=> equal values (also -0.0, NaN)."""
    t = t.detach().contiguous()
    if t.is_floating_point() or t.is_complex():
        t = t.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[t.element_size()])
    return t.reshape(-1).to(torch.int64)


def digest(tensors: Any) -> str:
    """A short hash of every tensor's shape and bits, in order (nested tuples, lists, dicts)."""
    h = hashlib.sha1()
    for t in _leaves(tensors):
        h.update(str(tuple(t.shape)).encode())
        h.update(bits(t).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _leaves(batch: Any) -> Iterator[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, dict):
        for key in sorted(batch, key=str):
            yield from _leaves(batch[key])
    elif isinstance(batch, (tuple, list)):
        for item in batch:
            yield from _leaves(item)


def map_rows(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply `fn` to every tensor of the batch that has rows (dim 0); keep the batch's structure."""
    if isinstance(batch, torch.Tensor):
        return fn(batch) if batch.dim() > 0 else batch
    if isinstance(batch, dict):
        return type(batch)({k: map_rows(v, fn) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(map_rows(v, fn) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(map_rows(v, fn) for v in batch)
    return batch


def shard(batch: Any, rank: int, world: int, *, interleaved: bool) -> Any:
    """Rank `rank`'s rows of a global batch: every world-th row (the sampler's way) or a contiguous slice."""

    def take(t: torch.Tensor) -> torch.Tensor:
        if t.shape[0] % world:
            raise problem(
                f"a batch tensor has {t.shape[0]} rows, which do not split over {world} ranks",
                f"Return global batches with a multiple of {world} rows",
            )
        if interleaved:
            return t[rank::world]
        size = plan_batch(t.shape[0], None, world_size=world).per_rank  # the loader's split
        return t[rank * size : (rank + 1) * size]

    return map_rows(batch, take)


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A tensor's full value: FSDP's sharded DTensors are gathered (a collective: every rank calls it)."""
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _state(net: nn.Module, sharded: bool = False) -> dict[str, torch.Tensor]:
    return {name: t.clone().cpu() for name, t in _live(net, sharded).items()}


def _modules_of_note(net: nn.Module) -> tuple[list[str], list[str]]:
    norms = [
        name
        for name, m in net.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and "SyncBatchNorm" not in type(m).__name__
    ]
    drops = [
        name or type(m).__name__
        for name, m in net.named_modules()
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0
    ]
    return norms, drops


def _stream(spec: VerifySpec, s: ddpkit.Session, world: int) -> Iterator[tuple[Any, list[str]]]:
    """(the batch this process trains on, the hashes of every rank's shard of the global batch)."""
    if spec.data is not None:
        loader = s.loader(build_data(spec), batch_size=spec.batch_size, shuffle=spec.shuffle, drop_last=True)
        # A map-style data set is split by DistributedSampler (rank r: rows r, r+W, ... of the global
        # batch); an iterable one by contiguous slices (ddpkit.data.streams): no sampler then.
        interleaved = loader.sampler is not None
        while True:
            for batch in loader:
                if world == 1:
                    n, split = spec.nproc, interleaved
                    shards = [digest(shard(batch, r, n, interleaved=split)) for r in range(n)]
                else:
                    shards = [digest(batch)]
                yield batch, shards
    source = resolve(spec.batches, "batches")
    step = 0
    while True:
        whole = source(step)
        step += 1
        parts = [shard(whole, r, spec.nproc, interleaved=False) for r in range(spec.nproc)]
        if world == 1:
            yield ddpkit.to_device(whole, s.device), [digest(p) for p in parts]
        else:
            yield ddpkit.to_device(parts[s.rank], s.device), [digest(parts[s.rank])]


class Chunked(nn.Module):
    """Forward a batch in `chunks` pieces and concatenate the outputs (a noise-floor variant).

    The kernels then see smaller batches and the weight gradients are sums of per-piece gradients,
    rounded the way DDP's shards round them (in bf16 autocast each piece's gradient is rounded to
    bf16), while the loss still sees the whole batch, so a summed loss keeps its meaning.
    """

    def __init__(self, inner: nn.Module, chunks: int) -> None:
        super().__init__()
        self.inner = inner
        self.chunks = chunks

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        rows = next(_leaves([args, kwargs])).shape[0]
        pieces = []
        for i in range(self.chunks):

            def take(t: torch.Tensor, i: int = i) -> torch.Tensor:
                return torch.tensor_split(t, self.chunks)[i] if t.shape[0] == rows else t

            pieces.append(self.inner(*map_rows(list(args), take), **map_rows(kwargs, take)))
        return _concat(pieces)


def _concat(outputs: list[Any]) -> Any:
    first = outputs[0]
    if isinstance(first, torch.Tensor) and first.dim() > 0:
        return torch.cat(outputs)
    if isinstance(first, dict):  # an HF ModelOutput too; its key-value cache (not tensors) is left out
        return type(first)({k: _concat([o[k] for o in outputs]) for k in first if _joinable(first[k])})
    if isinstance(first, (tuple, list)):  # an HF model's tuple (return_dict=False): its cache left out too
        return type(first)(
            _concat(list(parts)) if _joinable(parts[0]) else None for parts in zip(*outputs, strict=True)
        )
    scalar = isinstance(first, torch.Tensor)
    what = "a scalar tensor (a loss computed from labels?)" if scalar else type(first).__name__
    raise problem(
        f"the model returns {what}, which the 'chunked' noise-floor variant cannot combine over pieces "
        "of the batch",
        "Compute the loss in --loss from the model's outputs (e.g. logits) rather than passing labels to "
        "the model, or pass floor=('permuted',) (--floor permuted)",
    )


def _joinable(value: Any) -> bool:
    return isinstance(value, (torch.Tensor, dict, tuple, list))


def _permute(batch: Any, step: int) -> Any:
    """The same global batch with its rows in another (fixed, per step) order."""
    rows = next(_leaves(batch)).shape[0]
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(10_007 + step))
    return map_rows(batch, lambda t: t[order.to(t.device)] if t.shape[0] == rows else t)


def _precision_batch(spec: VerifySpec, batch: Any) -> Any:
    if spec.precision != "fp64":
        return batch
    return map_rows(batch, lambda t: t.double() if t.is_floating_point() else t)


def _replica_diff(s: ddpkit.Session, tensors: dict[str, torch.Tensor]) -> dict[str, float]:
    """Names of the tensors whose bits differ between ranks, with their largest spread (max - min)."""
    flat = torch.cat([bits(t) for t in tensors.values()]).to(s.device)
    hi, lo = flat.clone(), flat
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    differ = (hi != lo).cpu()
    names, offset = [], 0
    for name, t in tensors.items():
        if differ[offset : offset + t.numel()].any():
            names.append(name)
        offset += t.numel()
    if not names:
        return {}
    values = torch.cat([tensors[n].detach().double().reshape(-1) for n in names]).to(s.device)
    top, bottom = values.clone(), values.clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    dist.all_reduce(bottom, op=dist.ReduceOp.MIN)
    spread, out, offset = (top - bottom).cpu(), {}, 0
    for n in names:
        out[n] = float(spread[offset : offset + tensors[n].numel()].max())
        offset += tensors[n].numel()
    return out


def train(spec: VerifySpec, s: ddpkit.Session, *, permuted: bool = False, chunks: int = 0) -> Trajectory:
    """Train `spec.steps` steps in session `s` (world size 1: the global batch; else this rank's shard).

    `permuted` and `chunks` select a noise-floor variant of the single run (see `run_single`).
    """
    world = s.world_size
    keep = world == 1 or s.rank == 0
    out = Trajectory(rank=s.rank, world=world)
    loss_fn = build_loss(spec)
    module = build_model(spec)
    out.batchnorm, out.dropout = _modules_of_note(module)
    out.init_hash = digest(list(module.state_dict().values()))
    ddp_options = {
        "sync_batchnorm": spec.sync_batchnorm,
        "find_unused_parameters": spec.find_unused_parameters,
        "static_graph": spec.static_graph,
    }
    compiled = spec.compile and world > 1  # DDP/FSDP + compile against one eager process
    if compiled:
        torch._dynamo.reset()  # graphs cached from an earlier run in this process would not be counted
    options: dict[str, Any] = ddp_options if spec.strategy == "ddp" else {}  # DDP's keywords only
    model = s.model(module, strategy=spec.session_strategy(), compile=compiled, **options)
    net = ddpkit.unwrap(model)
    out.strategy = s.strategy.describe()
    sharded = s.strategy.shards_state  # FSDP: gather whole tensors on every rank before comparing
    if spec.after_wrap is not None:
        resolve(spec.after_wrap, "after_wrap")(net, s)
    optimizer = build_optimizer(spec, model.parameters())
    out.params = [name for name, _ in net.named_parameters()]
    stream = _stream(spec, s, world)
    autocast = spec.precision_plan(s.device.type).forward_context()  # the library's own autocast
    step, graphs_before = 0, _graphs_compiled()
    try:
        if world > 1:
            out.replica_diff.append(_replica_diff(s, _live(net, sharded)))
        if keep or sharded:
            state = _state(net, sharded)
            if keep:
                out.states.append(state)
        for step in range(1, spec.steps + 1):
            batch, hashes = next(stream)
            out.batch_hashes.append(hashes)
            batch = _precision_batch(spec, _permute(batch, step) if permuted else batch)
            rng = _rng_state(s.device) if step == 1 else None
            with autocast:
                loss = loss_fn(Chunked(model, chunks) if chunks else model, batch)
            if isinstance(loss, tuple):  # (loss_sum, valid tokens): the global token mean (step.tokens)
                loss = tokens.global_mean(s, *loss)
            if rng is not None:
                out.random_forward = any(
                    not torch.equal(a, b) for a, b in zip(rng, _rng_state(s.device), strict=True)
                )
            optimizer.zero_grad(set_to_none=True)
            if spec.shard_optimizer is None:
                loss.backward()
            else:
                s.backward(loss)  # s.step(opt) below: the session's own backward-step pair
            if step == 1 and (keep or sharded) and not (world > 1 and spec.shard_optimizer == "gradients"):
                grads = {  # (reduce-scattered in s.step: before it a rank's .grad is its own, unreduced)
                    n: None if p.grad is None else _whole(p.grad).clone().cpu()
                    for n, p in net.named_parameters()
                }
                if keep:
                    out.grads = grads
            if spec.shard_optimizer is None:
                optimizer.step()  # every rank steps everything (plain DDP), so per-rank optimizer bugs show
            else:
                s.step(optimizer)  # the sharded step under test
            out.losses.append(float(s.all_reduce(loss.detach().float(), op="mean")))
            if world > 1:
                out.replica_diff.append(_replica_diff(s, _live(net, sharded)))
            if keep or sharded:
                state = _state(net, sharded)
                if keep:
                    out.states.append(state)
    except Exception as exc:
        if world == 1:
            raise
        out.error = f"{type(exc).__name__}: {exc}"
        out.error_step = step
        out.error += "\n" + traceback.format_exc(limit=-3)
    out.graphs_compiled = _graphs_compiled() - graphs_before
    if spec.shard_optimizer is not None:
        sharder = s.stepper.sharded_step(optimizer)
        out.step_path = sharder.describe() if sharder is not None else "optimizer step not sharded"
    return out


def _graphs_compiled() -> int:
    """Distinct graphs torch.compile has built in this process (Dynamo's count). A model that is an
    OptimizedModule can still run eagerly (every frame skipped), so `--compile` checks this moved."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _rng_state(device: torch.device) -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def _live(net: nn.Module, sharded: bool = False) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = dict(net.named_parameters())
    tensors.update(net.named_buffers())
    return {n: _whole(t) for n, t in tensors.items()} if sharded else tensors


def run_single(
    spec: VerifySpec, *, variant: str = "reference", threads: int = 1, pieces: int = 0
) -> Trajectory:
    """The single-process run on the global batch, in this process; a `variant` changes only sum orders.

    "permuted": each global batch with its rows in another order; "chunked": forward in `pieces`
    pieces (default nproc + 1, never DDP's shards); "threads": another CPU thread count; "features":
    every linear layer's sum over its input features in 3 pieces (the order tensor parallelism changes).
    """
    saved = torch.get_num_threads()
    if variant == "threads":
        threads = threads * 2 if threads == 1 else threads // 2
    torch.set_num_threads(threads)
    try:
        split = FeatureSplit() if variant == "features" else contextlib.nullcontext()
        with ddpkit.session(seed=spec.seed, device=spec.device, env={}, verbose=False) as s, split:
            chunks = (pieces or spec.nproc + 1) if variant == "chunked" else 0
            return train(spec, s, permuted=variant == "permuted", chunks=chunks)
    finally:
        torch.set_num_threads(saved)


def ddp_rank(spec: VerifySpec) -> bytes:
    """One DDP rank of the check, its `Trajectory` pickled; run by `ddpkit.spawn` on `spec.nproc` ranks.

    Pickled here because tensors sent through a torch.multiprocessing queue travel as shared-memory
    handles, which vanish when the rank exits before the parent has read them.
    """
    shard = "auto" if spec.shard_optimizer is None else spec.shard_optimizer  # "auto": the session's default
    with ddpkit.session(
        seed=spec.seed,
        device=spec.device,
        timeout=spec.timeout,
        verbose=False,
        strategy=spec.session_strategy(),
        shard_optimizer=shard,
    ) as s:
        if s.world_size != spec.nproc:
            raise problem(
                f"the check runs on {s.world_size} rank(s) but nproc={spec.nproc}",
                f"Launch {spec.nproc} ranks, or pass nproc={s.world_size}",
            )
        return pickle.dumps(train(spec, s))
