"""A step that runs out of memory: every rank learns it in the same step, and (opt-in) it is re-run split.

    with ddpkit.session(micro_batch="auto") as s:        # opt in
        ddpkit.fit(s, model, opt, loader, train_step)     # a step that runs out of memory on any rank is
                                                          # dropped and re-run as 2 micro-batches of half

Why this shape: a rank that runs out of memory raises, while its peers go on into the next collective
(DDP's all-reduce of a bucket in the backward) and wait there for it until the timeout. So with
`micro_batch="auto"` no collective runs inside a micro-batch's backward: every micro-batch runs under the
strategy's skipped sync (DDP's `no_sync`), each `s.accumulate` block ends with one all-reduce of a flag
per rank (`AutoMicroBatch.agree`: every rank reaches it, also one that raised, so all ranks learn in the
same block who ran out), and the step's gradients are all-reduced by `reduce` just before the optimizer
step. The price: the gradient all-reduce no longer overlaps the backward, plus one 8-byte-per-rank
all-reduce per micro-batch. On an agreed out-of-memory error every rank raises `StepOutOfMemory`;
`ddpkit.fit` catches it, drops the step's gradients (none was applied: the optimizer steps only after
the last block), doubles the parts each loader micro-batch runs as (`AutoMicroBatch.parts`, cut by
`ddpkit.step.micro_batches.split`), so the stepper's blocks per step (`Stepper.blocks`) double, the
global batch and the update stay those of the step that failed, and re-runs the step's batches. The
split is saved with the stepper's state, so a resumed run starts at the size that worked.

Where the memory went: the rank that ran out counts, before its failed step's frames are freed, its
model state from the live tensors (parameters, gradients, optimizer state: the categories of `ddpkit
plan --memory`), the micro-batch's own share (on CUDA the allocator's allocated bytes minus the model
state; on CPU ranks the resident set's growth since the block began, one read of /proc/self/statm per
block) and the allocation that failed; the figures travel in the same agreement all-reduce (one row of
six float64 per rank), so every rank's `StepOutOfMemory` says them (`describe_where`).

Without the opt-in an out-of-memory error becomes a one-paragraph `DdpkitError` (`explain`) naming the
rank, the allocation and what to do, instead of an allocator's trace; the launcher ends the peers.

On CPU ranks torch raises a `RuntimeError` from its `DefaultCPUAllocator` when malloc fails (e.g. past an
address-space limit, `RLIMIT_AS`); on CUDA `torch.OutOfMemoryError`. `is_oom` knows both.
FSDP and HSDP all-gather in the forward and backward, so a rank stopping part-way would leave its peers
in a collective: there the split is chosen before the first step from an estimate (`ahead`,
`ddpkit.training.oom_ahead`), the blocks run as without the opt-in, and an out-of-memory error is
`explain`'s paragraph plus that estimate. Not covered: SyncBatchNorm (its forward is a collective), and
a rank the kernel's OOM killer ends (nothing to catch: the launcher reports the kill).
"""

from __future__ import annotations

import contextlib
import os
import re
import traceback
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.errors import DdpkitError, problem
from ddpkit.parallel.modules import ddp_of

_CPU_OOM = re.compile(r"DefaultCPUAllocator: (can't allocate memory|not enough memory)")
_BYTES = re.compile(r"(?:allocate|Tried to allocate) (\d+(?:\.\d+)?) ?(bytes|[KMG]iB)")
BUCKET_BYTES = 25 << 20  # the deferred gradient all-reduce flattens this much per call (DDP's default cap)


def is_oom(exc: BaseException) -> bool:
    """True for an allocation failure: CUDA's `torch.OutOfMemoryError` or the CPU allocator's."""
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and bool(_CPU_OOM.search(str(exc)))
    )


def _asked(exc: BaseException) -> str:
    n = _asked_bytes(exc)
    return f" (an allocation of {n / (1 << 20):.1f} MiB)" if n else ""


class StepOutOfMemory(DdpkitError):
    """Raised on every rank in the same `s.accumulate` block when any rank ran out of memory there;
    `where` holds, per rank that ran out, where its memory was at the failure (`WHERE`, bytes)."""

    def __init__(
        self, message: str, ranks: Sequence[int], where: Mapping[int, Mapping[str, int]] | None = None
    ) -> None:
        super().__init__(message)
        self.ranks = list(ranks)
        self.where = {r: dict(w) for r, w in (where or {}).items()}


# Where a rank's memory was when an allocation failed: the model state counted from the live tensors
# (each storage once), the micro-batch's own share (what it had allocated when it failed: its
# activations and temporaries), and the allocation that failed.
WHERE = ("parameters", "gradients", "optimizer_state", "micro_batch", "failed")
WHERE_LABELS = {
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer_state": "optimizer state",
    "micro_batch": "this micro-batch's activations and temporaries",
    "failed": "the allocation that failed",
}


def _storage_bytes(tensors: Iterator[Any], seen: set[int]) -> int:
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor (FSDP2): this rank's shard
        storage = local.untyped_storage()
        key = storage.data_ptr() or id(storage)
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def model_state(model: nn.Module | None, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """Bytes of the parameters (and buffers), gradients and optimizer state, from the live tensors:
    the same categories as `ddpkit plan --memory`'s breakdown."""
    seen: set[int] = set()
    params = list(model.parameters()) + list(model.buffers()) if model is not None else []
    if optimizer is not None:  # parameters the optimizer holds that the model does not (rare)
        params += [p for g in optimizer.param_groups for p in g["params"]]
    return {
        "parameters": _storage_bytes(iter(params), seen),
        "gradients": _storage_bytes((p.grad for p in params if p.grad is not None), seen),
        "optimizer_state": 0
        if optimizer is None
        else _storage_bytes((v for st in optimizer.state.values() for v in st.values()), seen),
    }


def _resident() -> int:
    """This process's resident set in bytes (/proc/self/statm: cheap, no allocation of note); 0 when
    the system has none."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


_PAGE = os.sysconf("SC_PAGE_SIZE")


def _asked_bytes(exc: BaseException) -> int:
    m = _BYTES.search(str(exc))
    if not m:
        return 0
    return int(float(m.group(1)) * {"bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[m.group(2)])


def describe_where(rank: int, where: Mapping[str, int], device_type: str) -> str:
    """One line: where a rank's memory was when it ran out, by category."""
    parts = [f"{WHERE_LABELS[k]} {where.get(k, 0) / (1 << 20):.1f} MiB" for k in WHERE]
    how = (
        "torch's allocator: allocated at the failure minus the model state"
        if device_type == "cuda"
        else "the rank's resident memory grown since the micro-batch began"
    )
    return f"where rank {rank}'s memory was when it ran out: {', '.join(parts)} ({how})"


def explain(exc: BaseException, rank: int, micro_batch: int | None = None, ahead: str = "") -> DdpkitError:
    """The paragraph shown instead of the allocator's trace (`ahead`: FSDP's estimate, `ahead_note`)."""
    size = f" at micro-batch {micro_batch} per rank" if micro_batch else ""
    half = ""
    if micro_batch and micro_batch > 1:
        half = f" (micro-batch {micro_batch // 2} with twice the accumulation)"
    return problem(
        f"rank {rank} ran out of memory in a training step{size}{_asked(exc)}; no update was applied "
        f"from that step{ahead}",
        "Halve the micro-batch and double the accumulation to keep the global batch"
        f"{half}, or let ddpkit do it when it happens: ddpkit.session(micro_batch='auto') with ddpkit.fit; "
        "`ddpkit plan --memory --model ... --device ...` names the largest micro-batch that fits, before "
        "you run",
    )


class AutoMicroBatch:
    """The opt-in's state on one rank: how many parts each loader micro-batch is split into (`parts`),
    the agreement after every block, and the deferred gradient all-reduce."""

    def __init__(self, *, rank: int, world: int, distributed: bool, device: torch.device):
        self.parts = 1  # each loader micro-batch runs as this many (a power of two); `Stepper.blocks`
        self.rank, self.world, self.distributed, self.device = rank, world, distributed, device
        self.splits: list[dict[str, int]] = []  # every split so far: {"step": n, "parts": p}
        self.model: nn.Module | None = None  # what `watch` names: counted in the breakdown at a failure
        self.optimizer: torch.optim.Optimizer | None = None
        self._block_start = 0  # CPU: the resident set when the current block began
        self.last_oom: dict[int, dict[str, int]] = {}  # the last agreed OOM: rank -> `where` figures
        self.ahead = False  # FSDP/HSDP: the split chosen before the first step (`training.oom_ahead`)
        self.estimate: dict[str, float] = {}  # `ahead`: the estimate it was chosen by; `ahead_note` says it
        self.ahead_note = ""

    def watch(self, model: nn.Module | None, optimizer: torch.optim.Optimizer | None) -> None:
        """The model and optimizer whose state an out-of-memory breakdown counts (`ddpkit.fit` names
        them); without them the breakdown holds the micro-batch's share and the failed allocation."""
        self.model, self.optimizer = model, optimizer

    def block_started(self) -> None:
        """At the start of every block: on CPU ranks the resident set (one read of /proc/self/statm),
        so a failure can say how much the micro-batch itself had taken. On CUDA nothing: the allocator
        says it at the failure."""
        if self.device.type != "cuda":
            self._block_start = _resident()

    def where(self, failed: BaseException) -> dict[str, int]:
        """Where this rank's memory was when `failed` was raised, by `WHERE`'s categories (called
        before the failed step's frames are cleared, so its activations are still held)."""
        state = model_state(self.model, self.optimizer)
        if self.device.type == "cuda":
            held = torch.cuda.memory_allocated(self.device)
            step = max(0, held - sum(state.values()))
        else:
            step = max(0, _resident() - self._block_start) if self._block_start else 0
        return {**state, "micro_batch": step, "failed": _asked_bytes(failed)}

    def _where_row(self, failed: BaseException) -> list[float]:
        """`where` in `WHERE`'s order; zeros when counting itself fails (the agreement must go on)."""
        try:
            w = self.where(failed)
        except Exception:  # e.g. the device still full: the figures are a report, not the protocol
            return [0.0] * len(WHERE)
        return [float(w[k]) for k in WHERE]

    def agree(self, failed: BaseException | None) -> None:
        """One all-reduce (a row per rank: a flag, 1 out of memory, 2 another error, and for a rank out of
        memory where its memory was, `WHERE`), reached by every rank at the end of every block, also by
        a rank that raised. Any other error: every rank raises (the one
        that failed its own error), so no peer waits in the next block's all-reduce. Else any rank out
        of memory: `StepOutOfMemory` on every rank."""
        flags = torch.zeros(self.world, 1 + len(WHERE), dtype=torch.float64, device=self.device)
        if failed is not None:
            flags[self.rank, 0] = 1.0 if is_oom(failed) else 2.0
            if is_oom(failed):  # where its memory was, for every rank (fp64: exact to 2^53)
                flags[self.rank, 1:] = torch.tensor(self._where_row(failed), dtype=torch.float64)
        if self.distributed:
            dist.all_reduce(flags)
        rows = flags.tolist()
        state = [row[0] for row in rows]
        others = [r for r in range(self.world) if state[r] == 2.0]
        if others:
            if failed is not None and not is_oom(failed):
                raise failed
            raise problem(
                f"rank(s) {others} failed in this micro-batch (see their error); this rank stopped with them",
                "Fix the error that rank reports",
            ) from failed
        ranks = [r for r in range(self.world) if state[r] == 1.0]
        if ranks:
            own = f": {str(failed)[:300]}" if failed is not None else ""
            if failed is not None:  # its frames hold the step's activations: freed before the re-run
                traceback.clear_frames(failed.__traceback__)
            where = {r: {k: int(v) for k, v in zip(WHERE, rows[r][1:], strict=True)} for r in ranks}
            self.last_oom = where
            said = "; ".join(describe_where(r, where[r], self.device.type) for r in ranks)
            text = (
                f"rank(s) {ranks} ran out of memory in this micro-batch{own}. Every rank stopped here: "
                "ddpkit.fit runs the step again split; in a loop of your own, set the gradients to None "
                f"and run the step's batches again in halves with twice the accumulation. {said}"
            )
            raise StepOutOfMemory(text, ranks, where) from None

    def split_more(self, step: int) -> None:
        """After an agreed out-of-memory error: twice the parts (half the micro-batch, same global batch)."""
        self.parts *= 2
        self.splits.append({"step": step, "parts": self.parts})

    def chose_ahead(self, parts: int, estimate: Mapping[str, float], *, step: int, note: str) -> None:
        """FSDP/HSDP (`ddpkit.training.oom_ahead`): the split agreed before the first step, the estimate
        it was chosen by (saved with the state: a resumed run does not estimate again) and the clause an
        out-of-memory error then adds (`note`); `step`: the optimizer step the split starts at."""
        self.parts = parts
        self.estimate = dict(estimate)
        if parts > 1:
            self.splits.append({"step": step, "parts": parts})
        self.ahead_note = note

    def reduce(self, model: nn.Module | None) -> None:
        """The step's gradients averaged over the ranks, as DDP would have in the last backward: flat
        buckets of up to 25 MiB, summed, divided by the world size. A gradient that is None on this rank
        (a parameter its micro-batches did not reach) counts as zeros, so every rank sends the same list."""
        ddp = ddp_of(model) if model is not None else None
        if ddp is None or not self.distributed:
            return
        params = [p for p in ddp.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        bucket: list[torch.Tensor] = []
        size = 0
        for p in params:
            g = p.grad
            assert g is not None
            if bucket and (size + g.numel() * g.element_size() > BUCKET_BYTES or g.dtype != bucket[0].dtype):
                self._all_reduce(bucket)
                bucket, size = [], 0
            bucket.append(g)
            size += g.numel() * g.element_size()
        if bucket:
            self._all_reduce(bucket)

    def _all_reduce(self, grads: list[torch.Tensor]) -> None:
        flat = torch.cat([g.reshape(-1) for g in grads])
        flat.div_(self.world)  # before the sum, as DDP's reducer does
        dist.all_reduce(flat)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def state_dict(self) -> dict[str, Any]:
        return {"parts": self.parts, "splits": list(self.splits), "estimate": dict(self.estimate)}

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        if state:
            self.parts = int(state.get("parts", self.parts))
            self.splits = list(state.get("splits", self.splits))
            self.estimate = dict(state.get("estimate", self.estimate))


def auto_for(micro_batch: str | None, **where: Any) -> AutoMicroBatch | None:
    """The session's `micro_batch=` option: None (off) or "auto" (an `AutoMicroBatch`; `where`: rank,
    world, distributed, device); anything else is refused."""
    if micro_batch is None:
        return None
    if micro_batch != "auto":
        raise problem(
            f"micro_batch={micro_batch!r} is not 'auto' or None",
            "Pass micro_batch='auto' to re-run a step that runs out of memory as smaller "
            "micro-batches (same global batch), or leave it out; the loader's batch_size "
            "sets the micro-batch",
        )
    return AutoMicroBatch(**where)


class Wrapping(Protocol):
    """What `check` asks of the session's strategy (`ddpkit.strategy.Strategy` is one): whether its
    forward is a collective (FSDP, HSDP), and to keep how it wraps each model for the estimate ahead."""

    @property
    def collective_forward(self) -> bool: ...
    def keep_blueprints(self) -> None: ...


def check(strategy: Wrapping, shard: bool | str, invariant: bool, auto: AutoMicroBatch | None = None) -> None:
    """Refuse what `micro_batch="auto"` cannot make safe, with the fix; FSDP gets the split ahead."""
    if auto is not None:
        auto.ahead = strategy.collective_forward
        if auto.ahead:
            strategy.keep_blueprints()  # FSDP keeps the meta skeleton the estimate rebuilds
    if shard == "gradients" or invariant:
        what = "shard_optimizer='gradients'" if shard == "gradients" else "reproducible='any-world'"
        raise problem(
            f"micro_batch='auto' with {what}: both reduce the gradients their own way",
            f"Leave one of micro_batch='auto' and {what} out",
        )


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@contextlib.contextmanager
def guarded(auto: AutoMicroBatch | None) -> Iterator[None]:
    """Around one `s.accumulate` block. Opt-in: every rank agrees at its end (`AutoMicroBatch.agree`).
    Otherwise an out-of-memory error becomes the one paragraph of `explain`."""
    if auto is None or auto.ahead:  # ahead (FSDP): no agreement can be reached past a collective
        try:
            yield
        except Exception as exc:
            if is_oom(exc):
                raise explain(exc, _rank(), ahead=auto.ahead_note if auto else "") from exc
            raise
        return
    auto.block_started()
    try:
        yield
    except Exception as exc:
        auto.agree(exc)
        raise
    auto.agree(None)


@contextlib.contextmanager
def naming(micro_batch: int, rank: int, auto: AutoMicroBatch | None) -> Iterator[None]:
    """Inside a block whose micro-batch size the caller knows (`ddpkit.fit`): without the opt-in, the
    out-of-memory paragraph names that size and the half of it to try."""
    try:
        yield
    except Exception as exc:
        if (auto is None or auto.ahead) and is_oom(exc):
            raise explain(exc, rank, micro_batch, ahead=auto.ahead_note if auto else "") from exc
        raise
