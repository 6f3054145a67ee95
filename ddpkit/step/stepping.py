"""One optimizer step over k micro-batches: autocast, skipped sync, loss scaling, unscale, clip, step.

    for x, y in loader:                      # the loader's per-rank batch is global / (world x k)
        with s.accumulate(model):            # autocast; DDP's no_sync on micro-batches 1..k-1
            s.backward(loss_fn(model(x), y)) # loss / k (x the fp16 loss scale); autocast off for backward
        info = s.step(opt, max_norm=1.0)     # on micro-batch k: unscale, clip, step, zero_grad

Why this shape: every micro-batch is one `accumulate` block followed by one `s.step`, so the loop
body never changes with k, and the group boundary lives in one place (here), not in the user's
`if i % k` arithmetic. DDP all-reduces each bucket once, in the backward of the k-th micro-batch;
the gradients of the first k-1 pile up locally in `.grad` under `no_sync`. What "skip the sync" and
"clip" mean is the strategy's (`ddpkit.strategy`: DDP's `no_sync`, FSDP's
`set_requires_gradient_sync(False)` and a norm over sharded gradients). Dividing each loss by k makes
the summed gradient that of one batch of k x b samples (for a loss averaged over its batch).

Groups of k may span an epoch boundary (each optimizer step always uses exactly k micro-batches);
micro-batches left over at the very end of training (fewer than k) are not applied: `pending` says.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddpkit.errors import problem
from ddpkit.parallel.collectives import Ranks
from ddpkit.parallel.precision import LossScale, PrecisionPlan
from ddpkit.step import fingerprint, invariant, oom, shard_exchange, sharding, spike_norm, spikes
from ddpkit.step.tokens import Count, TokenWeighting
from ddpkit.strategy import Strategy, adapters


@dataclass(frozen=True)
class MicroBatch:
    """The micro-batch an `accumulate` block runs: `index` of `steps`; `sync` on the last one."""

    index: int
    steps: int

    @property
    def sync(self) -> bool:
        """True when this micro-batch all-reduces gradients and `s.step` steps the optimizer."""
        return self.index == self.steps - 1


@dataclass(frozen=True)
class StepInfo:
    """What `s.step(opt)` did.

    `stepped`: the optimizer stepped (False on micro-batches 1..k-1). `skipped`: fp16 only, the
    gradients held inf/nan, so the scaler skipped the update and lowered the loss scale.
    `grad_norm`: total gradient norm before clipping (when `max_norm` is given), identical on every
    rank because it is computed from the all-reduced gradients. `step`: optimizer steps so far.
    `spike`: set (with `skipped`) when the session's spike guard dropped the step on every rank.
    """

    stepped: bool
    skipped: bool = False
    grad_norm: torch.Tensor | None = None
    step: int = 0
    spike: spikes.Spike | None = None  # the spike guard skipped this step (`ddpkit.step.spikes`)


@dataclass(frozen=True, kw_only=True)
class StepParts:
    """What a session's stepper is made of besides its strategy, built once by the session: values and
    the step wing's own objects, never the session (so each option's walk ends in a named field)."""

    accumulation: int  # loader micro-batches per optimizer step (the session's `accumulation=`)
    precision: PrecisionPlan
    ranks: Ranks  # the cluster's Shape: device, distributed, world size
    report: Callable[[str], None]
    shard: bool | str = False  # shard_optimizer=
    timeout: float = 1800.0  # a publishing rank of the sharded step waits this long for its peers
    invariant: invariant.AnyWorld | None = None  # reproducible="any-world"
    micro_batch: oom.AutoMicroBatch | None = None  # micro_batch="auto"
    spikes: spikes.Judge | None = None  # spike_guard=
    fingerprints: fingerprint.ReplicaFingerprints | None = None  # fingerprint_every= (`step.fingerprint`)
    profiler: Profiled | None = None  # profile= (`observe.profiling`): advanced after every optimizer step


class Profiled(Protocol):
    """What the stepper calls of the session's profiler (`ddpkit.observe.profiling.StepProfiler`)."""

    def step(self) -> None: ...


class Stepper:
    """The accumulation state machine behind `Session.accumulate/backward/step` (one per session)."""

    def __init__(self, strategy: Strategy, parts: StepParts) -> None:
        self.spikes = parts.spikes  # spike_guard=: a step far above its window is skipped (`step.spikes`)
        self.fingerprints = parts.fingerprints  # fingerprint_every=: replicas compared (`step.fingerprint`)
        self.profiler = parts.profiler  # profile=: torch.profiler's schedule, one step per optimizer step
        self._agreed_loss: float | None = None  # fit's all-reduced loss for the next step, for the guard
        self._losses: list[torch.Tensor] = []  # the guard's: this rank's losses of the step in progress
        self.accumulation = parts.accumulation  # loader micro-batches per step: never reassigned
        self.oom = parts.micro_batch  # micro_batch="auto": deferred sync, agreed OOM (`ddpkit.step.oom`)
        if self.oom is not None:
            oom.check(strategy, parts.shard, parts.invariant is not None, self.oom)
        self.invariant = parts.invariant  # reproducible="any-world": s.invariant.step is the only step
        self.strategy = strategy  # the session's, built once before this stepper
        self.shard = parts.shard  # ddpkit.step.sharding: each rank steps its share of the parameters
        # shard="gradients": this session's DDP models whose gradients a sharded step may reduce-scatter
        self.exchange_candidates = shard_exchange.Candidates()
        self._sharded: weakref.WeakKeyDictionary[torch.optim.Optimizer, sharding.ShardedStep | None] = (
            weakref.WeakKeyDictionary()
        )  # the decision for each optimizer, made at its first step
        self._checked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()  # adapters.check_optimizer
        self.device = parts.ranks.device
        self._in_join = False
        self.timeout = parts.timeout  # a publishing rank waits this long for its peers, like a collective
        self.precision = parts.precision
        self.distributed = parts.ranks.distributed
        self.report = parts.report
        self.loss_scale = parts.precision.loss_scale()  # fp16's scaler (its owner drives it), or none
        self.steps = 0  # optimizer steps taken (skipped fp16 steps included)
        self.skipped = 0  # fp16 steps skipped for inf/nan gradients
        self._micro = 0  # accumulate blocks finished since the last optimizer step
        self._backwards = 0  # s.backward calls since the last optimizer step
        self._block: MicroBatch | None = None  # the block being run
        self._awaiting_step = False  # a block finished; s.step must come next
        self._model: nn.Module | None = None  # the block's model: its gradients are read only if cleared
        self.tokens = TokenWeighting(distributed=self.distributed, device=self.device, report=self.report)

    @property
    def blocks(self) -> int:
        """`s.accumulate` blocks per optimizer step: the loader micro-batches per step (`accumulation`,
        the session's, never changed) times the parts each runs as under micro_batch="auto"."""
        return self.accumulation * (self.oom.parts if self.oom is not None else 1)

    @property
    def pending(self) -> int:
        """Micro-batches accumulated since the last optimizer step (0..k-1 between steps)."""
        return self._micro

    def autocast(self) -> contextlib.AbstractContextManager:
        return self.precision.forward_context()

    @contextlib.contextmanager
    def accumulate(self, model: nn.Module) -> Iterator[MicroBatch]:
        if self._block is not None:
            raise problem(
                "`s.accumulate` blocks are nested", "Run one block per micro-batch, one after the other"
            )
        if self._awaiting_step:
            raise problem(
                "a new `s.accumulate` block started before `s.step(opt)` was called for the previous one",
                "Call s.step(opt) once after every block; it steps only on the last of the k micro-batches",
            )
        if self.distributed:
            self.strategy.expect(model, "s.accumulate")
        block = MicroBatch(self._micro, self.blocks)
        self._model = model  # not its parameters: listing them each block cost ~4% of a 5 ms GPU step
        deferred = not block.sync or (self.oom is not None and not self.oom.ahead)  # auto: reduced in s.step
        defer = self.strategy.skip_sync(model) if deferred else contextlib.nullcontext()
        self._block = block
        try:
            with oom.guarded(self.oom), defer, self.autocast():
                yield block
        finally:
            self._block = None
        self._micro += 1
        self._awaiting_step = True

    def adopt(self, ddp: DistributedDataParallel | None) -> None:
        """A model `s.model` wrapped in DDP (`parallel.modules.ddp_of`; None otherwise).
        reproducible="any-world": its all-reduce becomes an error (`invariant.AnyWorld.guard`);
        shard="gradients" on CPU ranks: its gradients may be reduce-scattered by the sharded step
        (`shard_exchange.Candidates`)."""
        if self.invariant is not None:
            self.invariant.guard(ddp)
        elif self.shard == "gradients" and self.device.type == "cpu":
            self.exchange_candidates.add(ddp)

    def _refuse_in_invariant_mode(self, call: str) -> None:
        if self.invariant is not None:
            raise problem(
                f"{call} ran in a session with reproducible='any-world': it would sum the gradients in "
                "DDP's order, so the weights would depend on the world size again (fit steps this way too)",
                "Step with loss = s.invariant.step(model, opt, batch, loss_fn) (loss_fn(module, chunk) "
                "returns the chunk's mean loss), or leave reproducible= out",
            )

    def backward(self, loss: torch.Tensor, tokens: Count | None = None) -> None:
        self._refuse_in_invariant_mode("s.backward(loss)")
        k = self.blocks
        if self._block is None and k > 1:
            raise problem(
                f"s.backward(loss) ran outside `with s.accumulate(model):` with accumulation={k}",
                "Put the forward and s.backward in the block, so the first k-1 micro-batches skip the "
                "gradient all-reduce and the step happens after k",
            )
        block = self._block
        if (
            block is not None
            and block.index > 0
            and self.strategy.grads_between_micro_batches
            and self._model is not None
            and all(p.grad is None for p in self._model.parameters() if p.requires_grad)
        ):
            raise problem(
                f"the gradients were cleared in the middle of an accumulation group (micro-batch "
                f"{block.index + 1} of {k})",
                "Remove opt.zero_grad() from the loop: s.step(opt) zeroes them after each optimizer step",
            )
        if (
            self.spikes is not None
        ):  # read only when the step's norm is not finite (`_stop_if_loss_not_finite`)
            self._losses.append(loss.detach())
        loss = self.loss_scale.scale(self.tokens.prepare(loss, tokens, k))  # loss / k (ddpkit.step.tokens)
        with torch.autocast(self.precision.device_type, enabled=False):  # backward runs outside autocast
            loss.backward()
        self._backwards += 1

    def step(self, optimizer: torch.optim.Optimizer, max_norm: float | None = None) -> StepInfo:
        self._refuse_in_invariant_mode("s.step(opt)")
        if isinstance(optimizer, torch.optim.Optimizer) and optimizer not in self._checked:  # frozen only?
            adapters.check_optimizer(optimizer)
            self._checked.add(optimizer)
        k = self.blocks
        if not self._awaiting_step:
            if k > 1 or self._backwards == 0:
                raise problem(
                    "s.step(opt) was called without a micro-batch since the last call",
                    "Call it exactly once after each `with s.accumulate(model):` block that ran "
                    "s.backward(loss)",
                )
            self._micro = k  # accumulation=1 without a block: s.backward(loss); s.step(opt)
        self._awaiting_step = False
        if self._micro < k:
            return StepInfo(stepped=False, step=self.steps)
        if self._backwards == 0:
            raise problem(
                f"no s.backward(loss) ran in the {k} micro-batch(es) before this s.step(opt)",
                "Call s.backward(loss) instead of loss.backward(): it divides by the accumulation steps "
                "and applies the fp16 loss scale",
            )
        self._micro = self._backwards = 0
        if self.oom is not None:  # micro_batch="auto": no backward reduced them (`ddpkit.step.oom`)
            self.oom.reduce(self._model)
        sharder = self._sharder(optimizer)
        if sharder is not None:  # ZeRO-2 on one machine: this rank's share of the gradients, reduced now
            sharder.reduce_gradients()
        if not self.tokens.settle(optimizer, accumulation=k, joining=self._in_join):
            optimizer.zero_grad(set_to_none=True)  # no valid token on any rank: nothing to learn from
            self._agreed_loss, self._losses = None, []
            return StepInfo(stepped=False, skipped=True, step=self.steps)
        # fp16: unscaled; a sharded step's overflow flags agreed by every rank (a share's inf/nan)
        self.loss_scale.unscale(optimizer, agree=sharder.agree_found_inf if sharder is not None else None)
        norm = None
        if max_norm is not None or self.spikes is not None:  # the guard's norm: without one, the norm alone
            params = [p for group in optimizer.param_groups for p in group["params"]]
            clip, bound = (
                (spike_norm.grad_norm, math.inf) if max_norm is None else (self.strategy.clip, max_norm)
            )
            norm = clip(params, bound) if sharder is None else sharder.clip(params, bound, clip)
        spike = self._judge(norm)
        if spike is not None:  # the same decision on every rank: no update, the gradients dropped
            if self.loss_scale.active:  # fp16: close the scaler's unscale bookkeeping, no update run
                self.loss_scale.step(optimizer, _skip)
            optimizer.zero_grad(set_to_none=True)
            self.steps += spike.counted
            return StepInfo(stepped=True, skipped=True, grad_norm=norm, step=self.steps, spike=spike)
        skipped = self.loss_scale.step(optimizer, sharder.step if sharder is not None else _run)
        optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        self._after_update(optimizer)
        if skipped:
            self.skipped += 1
            self.report(
                f"ddpkit: optimizer step {self.steps} skipped: fp16 gradients held inf/nan; loss scale "
                f"lowered to {self.loss_scale.get_scale():g} ({self.skipped} skipped so far)"
            )
        return StepInfo(stepped=True, skipped=skipped, grad_norm=norm, step=self.steps)

    def _after_update(self, optimizer: torch.optim.Optimizer) -> None:
        """After an applied step: compare the replicas when due (every rank reaches the same step; the
        optimizer's state only when every rank holds all of it, not under the sharded step), then
        advance the profiler's schedule."""
        if self.fingerprints is not None and self.distributed and not self._in_join:
            replicated = optimizer if self.sharded_step(optimizer) is None else None
            self.fingerprints.after_step(self.steps, self._model, replicated)
        if self.profiler is not None:
            self.profiler.step()

    def check_replicas(self) -> None:
        """Before a save: compare the replicas now unless this step was just compared (nothing drifted
        is written; one all-reduce of two int64 per save)."""
        f = self.fingerprints
        if f is not None and self.distributed and f.every > 0 and f.last_agreed != self.steps:
            f.check(self.steps, self._model)

    def agree_loss(self, loss: float) -> None:
        """The loss of the step about to be taken, for the spike guard: a value identical on every rank
        (`ddpkit.fit` passes the mean its all-reduce before the step already computed)."""
        self._agreed_loss = loss

    def _judge(self, norm: torch.Tensor | None) -> spikes.Spike | None:
        loss, self._agreed_loss = self._agreed_loss, None
        losses, self._losses = self._losses, []
        if self.spikes is None or norm is None:
            return None
        value = float(norm)  # the all-reduced gradients' norm: the same bits on every rank
        if self.loss_scale.active and not math.isfinite(value):
            return None  # fp16: the scaler skips this step and lowers the scale
        if loss is None and not math.isfinite(value):  # an `s.step` loop (fit has checked its loss)
            self._stop_if_loss_not_finite(losses)
        values = {"grad_norm": value} if loss is None else {"loss": loss, "grad_norm": value}
        return self.spikes.judge(self.steps + 1, values)

    def _stop_if_loss_not_finite(self, losses: list[torch.Tensor]) -> None:
        """In an `s.step` loop under the guard, a step whose gradient norm is not finite: stop, as
        `ddpkit.fit` does, when a loss of it was not finite on any rank. The guard would skip that step
        and every later one a nan loss makes (a loss nan from the first step: every step), and the run
        would end untrained with exit code 0. The norm is agreed, so every rank comes here in the same
        step: one all-reduce of a flag per rank, on this path only (a finite norm costs nothing)."""
        bad = any(not bool(torch.isfinite(loss).all()) for loss in losses)
        ranks = [0] if bad else []
        if self.distributed:
            flags = torch.zeros(dist.get_world_size(), dtype=torch.float64, device=self.device)
            flags[dist.get_rank()] = float(bad)
            dist.all_reduce(flags)
            ranks = [r for r, flag in enumerate(flags.tolist()) if flag > 0]
        if ranks:
            raise problem(
                f"the training loss is not finite (nan or inf) at optimizer step {self.steps + 1} on rank(s) "
                f"{ranks}; the spike guard would skip this step and every later one like it, so the run "
                "would end untrained: every rank stopped before applying that step, so the weights are those "
                f"after step {self.steps}",
                "Lower the learning rate, clip gradients (max_norm=...), check the data that rank read, or "
                "use precision='32'",
            )

    @property
    def scaler(self) -> LossScale | None:
        """fp16's loss scale (`get_scale()`), None for the other precisions."""
        return self.loss_scale if self.loss_scale.active else None

    def sharded_step(self, optimizer: Any) -> sharding.ShardedStep | None:
        """The optimizer's sharded step (`ddpkit.step.sharding`) once it takes sharded steps, else None."""
        return self._sharded.get(optimizer) if isinstance(optimizer, torch.optim.Optimizer) else None

    def optimizer_state(self, optimizer: Any) -> dict | None:
        """The full `state_dict()` of an optimizer, gathered when its step is sharded (collective then:
        every rank calls it; rank 0 gets the state, the others None)."""
        sharded = self.sharded_step(optimizer)
        return optimizer.state_dict() if sharded is None else sharded.full_state_dict()

    def loaded_optimizer_state(self, optimizer: Any) -> None:
        """After loading a full optimizer state: keep only this rank's share when the step is sharded."""
        sharded = self.sharded_step(optimizer)
        if sharded is not None:
            sharded.drop_foreign_state()

    def _sharder(self, optimizer: torch.optim.Optimizer) -> sharding.ShardedStep | None:
        if not self.distributed or self.shard is False or not self.strategy.allows_sharded_step:
            return None
        if self._in_join:
            if self.sharded_step(optimizer) is not None:
                raise problem(
                    "s.join began after sharded optimizer steps: inside it, a rank that ran out of data "
                    "cannot update its share of the parameters",
                    "Enter `with s.join(model):` before the first s.step, or pass shard_optimizer=False "
                    "to ddpkit.session",
                )
            return None
        if optimizer not in self._sharded:
            self._sharded[optimizer] = sharding.choose(
                optimizer,
                self.shard,
                self.device,
                timeout=self.timeout,
                report=self.report,
                candidates=self.exchange_candidates,  # empty unless shard_optimizer="gradients"
            )
        return self._sharded[optimizer]

    @contextlib.contextmanager
    def joining(self) -> Iterator[None]:
        """Inside `s.join`: whole optimizer steps on every rank (see `_sharder`)."""
        self._in_join = True
        try:
            yield
        finally:
            self._in_join = False
            # the ranks that ran out of batches took fewer steps: their counts differ from here on, so
            # a check due "at step N" would no longer meet on every rank
            self.fingerprints = None

    def drop_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Abandon the optimizer step in progress (after `oom.StepOutOfMemory`, on every rank): its
        gradients dropped, the group restarted (its blocks per step are the split's: `blocks`)."""
        optimizer.zero_grad(set_to_none=True)
        if self._model is not None:
            self._model.zero_grad(set_to_none=True)
        self._micro = self._backwards = 0
        self._block, self._awaiting_step = None, False
        self._agreed_loss, self._losses = None, []
        self.tokens.drop()

    def state_dict(self) -> dict:
        """The loss scale (fp16) and step counts, for checkpoints; save between optimizer steps, since
        the gradients of a group in progress (`pending` > 0) are not part of it."""
        state = {
            "scaler": self.loss_scale.state_dict(),
            "steps": self.steps,
            "skipped": self.skipped,
            "tokens": self.tokens.state_dict(),
        }
        if self.oom is not None:
            state["micro_batch"] = self.oom.state_dict()  # a resume starts at the split that worked
        if self.spikes is not None:
            state["spikes"] = self.spikes.state_dict()  # a resume judges against the same window
        return state

    def load_state_dict(self, state: dict) -> None:
        if self.oom is not None:
            self.oom.load_state_dict(state.get("micro_batch"))
        self.loss_scale.load_state_dict(state.get("scaler"))
        self.steps = int(state.get("steps", self.steps))
        self.skipped = int(state.get("skipped", self.skipped))
        self.tokens.load_state_dict(state.get("tokens", {}))
        if self.spikes is not None:
            self.spikes.load_state_dict(state.get("spikes"))


def _run(update: Callable[[], Any]) -> Any:
    return update()


def _skip(update: Callable[[], Any]) -> None:
    """The optimizer update not run (a step the spike guard skipped)."""
