"""An optional training loop, written on ddpkit's public API: `fit(s, model, opt, loader, train_step)`.

    on_fit_start
    for each epoch (up to `epochs`, or until `max_steps` optimizer steps):
        on_epoch_start
        for batch in train_loader:                       # one micro-batch; k of them per optimizer step
            on_step_start                                # before the first micro-batch of a step
            with s.accumulate(model), the model's loss context (loss parallel: loss_parallel()):
                s.backward(train_step(model, batch))
            on the k-th micro-batch, ONE all-reduce of [non-finite flag per rank, stop request, loss]:
                a non-finite loss on any rank -> DdpkitError on every rank, naming the step and rank(s),
                before the optimizer applies it
            s.step(opt, max_norm) -> scheduler.step() -> on_step_end -> log row, s.log, progress
                (SpikeGuard(remedy="rollback") and a spike: every rank loads the last checkpoint, the
                step's samples are left out, the pass restarts there; later losses and evals dropped)
                (a replica drift, `ReplicaDrift` from the fingerprints in s.step or before a save, with
                on_drift="rollback": every rank loads the last checkpoint, written while the replicas
                agreed, compares them again and the pass restarts there; the same step drifting again,
                or a fourth drift, stops the run)
            every `eval_every` steps: on_eval_start -> evaluate -> on_eval_end
            a stop request (any rank, from a callback) ends the run after this step
        eval_every=None: on_eval_start -> evaluate -> on_eval_end at the end of the epoch
        on_epoch_end
    on_fit_end

Every decision that ends a loop is taken from all-reduced values, so all ranks leave together and
nobody waits in a collective the others never reach. Evaluation runs on the unwrapped module: DDP's
forward may broadcast buffers (a collective), and evaluation shards may differ by one batch. Under
FSDP the forward itself all-gathers, so the ranks evaluate in lockstep (`ddpkit.training.evaluation`).
Rank 0 alone shows progress (a tqdm bar on a terminal, plain lines in a log file: `ddpkit.observe.progress`),
writes the log (`.jsonl` or `.csv`) and the trackers (`s.log`: loss, lr, throughput in samples/s over
all ranks, step time in seconds, the clipped gradient norm, TFLOP/s and MFU per device; `eval/<metric>`
after each evaluation). Every rank marks its phases (data wait, forward, backward, sync wait, optimizer,
the loop's own work: `ddpkit.observe.anatomy`); every `anatomy_every` steps one all_gather brings the
ranks' medians to rank 0, which logs them per rank and names a persistently slow rank once, with the
phase its time goes to (`ddpkit.observe.slowrank`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from ddpkit.data import ShardedLoader
from ddpkit.errors import problem
from ddpkit.observe.metrics import Metric, MetricSet
from ddpkit.observe.monitor import StepMonitor, Window
from ddpkit.observe.progress import Progress, RunLog
from ddpkit.step.fingerprint import ReplicaDrift
from ddpkit.step.spikes import Spike
from ddpkit.step.stepping import StepInfo
from ddpkit.training.callbacks import Callback, FitResult, FitState
from ddpkit.training.evaluation import EvalStep, evaluate
from ddpkit.training.fit_plan import FitPlan, TrainStep, batch_len, check, total_steps
from ddpkit.training.oom_retry import SplitBlocks
from ddpkit.training.rollback import Rollback, Undone, not_rolled_back
from ddpkit.training.session import Session

__all__ = ["Callback", "FitResult", "FitState", "TrainStep", "evaluate", "fit"]  # the loop and its types


def fit(
    s: Session,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    train_loader: Iterable,
    train_step: TrainStep,
    *,
    epochs: int | None = None,
    max_steps: int | None = None,
    eval_loader: Iterable | None = None,
    eval_step: EvalStep | None = None,
    metrics: Mapping[str, Metric] | None = None,
    eval_every: int | None = None,
    scheduler: Any = None,
    scheduler_interval: str = "step",
    max_norm: float | None = None,
    callbacks: Sequence[Callback] = (),
    log: str | os.PathLike | None = None,
    log_every: int = 1,
    track_every: int = 10,
    progress: bool = True,
    flops: float | str | None = "count",
    anatomy_every: int = 10,
    on_drift: str = "rollback",
) -> FitResult:
    """Train `model` (from `s.model`) with `train_step(model, batch) -> loss`; see the module docstring.

    Stops after `epochs` passes or `max_steps` optimizer steps, whichever comes first. Evaluation
    (`eval_step(module, batch, metrics)` over `eval_loader`) runs every `eval_every` optimizer steps,
    or at the end of each epoch when `eval_every` is None. `scheduler` steps after each optimizer step
    (`scheduler_interval="step"`) or each epoch ("epoch"). Loss, learning rate, the clipped gradient
    norm, throughput and step time (averaged since the last report) go to `log` every `log_every` steps
    and to the session's trackers every `track_every` steps (`s.log` at the session's optimizer step
    `s.stepper.steps`, which a checkpoint restores; a TensorBoard write costs ~0.5 ms on rank 0).
    `flops`: "count" (the first micro-batch under torch's FLOP counter), the model FLOPs of one optimizer
    step on one device, or None (no FLOP/s, no MFU). `anatomy_every`: steps between the ranks' gathers.
    `on_drift`: what a replica drift (`session(fingerprint_every=)`) does: "rollback" (the default) loads
    the last checkpoint, written while the replicas agreed, and trains on; "stop" raises `ReplicaDrift`.
    Rollback is the default because it is what the drift's message tells one to do by hand, and the
    replay is the same computation: after a transient fault the run ends bitwise where it would have
    ended. It stops anyway (raising the drift, with why) where it cannot help: no checkpoint of every
    object fit trains with (model, optimizer, stepper, loader, scheduler), the replay drifting again at
    the same step (a cause in the computation), or a fourth drift in one call (a failing device).
    """
    check(epochs, max_steps, eval_loader, eval_step, metrics, eval_every, scheduler_interval, log_every)
    if track_every < 1:
        raise problem(f"track_every={track_every} is below 1", "Pass 1 or more")
    if on_drift not in ("rollback", "stop"):
        raise problem(
            f"on_drift={on_drift!r} is not a choice",
            "Pass on_drift='rollback' (back to the last checkpoint written while the replicas agreed) or "
            "on_drift='stop' (raise ReplicaDrift on every rank)",
        )
    plan = FitPlan(
        train_step,
        epochs,
        max_steps,
        max_norm,
        scheduler,
        scheduler_interval,
        log_every,
        track_every,
        eval_loader,
        eval_step,
        eval_every,
        tuple(callbacks),
    )
    total = total_steps(train_loader, epochs, max_steps, s.accumulation)
    bar = Progress(total) if progress and s.is_main else None
    metric_set = MetricSet(s, **(metrics or {}))
    monitor = StepMonitor(
        s,
        precision=s.precision.name,
        accumulation=s.accumulation,
        flops=flops,
        every=anatomy_every,
        main=s.is_main,
        report=s.print,
        anatomy=s.anatomy,
    )
    monitor.anatomy.watch(model)
    logger = RunLog(log, s.is_main, resumed=s.last_checkpoint is not None or s.stepper.steps > 0)
    loop = _Loop(s, FitState(s, model, optimizer), plan, metric_set, logger, bar, monitor, on_drift)
    return loop.run(train_loader)


class _Loop:
    """The pieces of `fit`, in the order of its pseudocode; one instance per call."""

    def __init__(
        self,
        s: Session,
        state: FitState,
        plan: FitPlan,
        metric_set: MetricSet,
        logger: RunLog,
        bar: Progress | None,
        monitor: StepMonitor,
        on_drift: str = "rollback",
    ) -> None:
        self.s, self.state, self.plan = s, state, plan
        self.metric_set, self.logger, self.bar, self.monitor = metric_set, logger, bar, monitor
        self.mark = monitor.anatomy.mark
        self.start = self.last_step_end = time.perf_counter()
        self.started_epochs = self.micro_batches = self.samples = 0  # samples: this rank's, this step
        self.rows, self.tracked = Window(), Window()  # since the last log row, the last s.log
        self.blocks = SplitBlocks(
            s, state.model, state.optimizer, plan.max_norm, self.counted, plan.train_step
        )
        judge = s.stepper.spikes
        self.rollback = judge is not None and judge.guard.remedy == "rollback"
        self.undo: Rollback | None = None  # remedy="rollback": the step's samples, the way back
        self.rolled_back = False  # the pass in progress was abandoned for a checkpoint's position
        self.skipped = 0  # optimizer steps of this call that applied no update (FitResult.skipped_steps)
        self.on_drift = on_drift  # fit(on_drift=): a replica drift rolls back ("stop": raised)
        self.drift_undo: Rollback | None = None  # the way back after a drift (self.undo when it exists)
        self.offset = s.stepper.steps  # the session's optimizer steps before this call (a resume's)

    def emit(self, name: str) -> None:
        for cb in self.plan.callbacks:
            getattr(cb, f"on_{name}")(self.state)

    def done(self) -> bool:  # from agreed values only: every rank gives the same answer
        return self.state.stopping or (
            self.plan.max_steps is not None and self.state.step >= self.plan.max_steps
        )

    def run(self, train_loader: Iterable) -> FitResult:
        s, state = self.s, self.state
        judge = s.stepper.spikes
        if self.rollback:
            if not isinstance(train_loader, ShardedLoader):
                raise problem(
                    "SpikeGuard(remedy='rollback') needs the training loader to be ddpkit's (s.loader(...)): "
                    "it leaves the spiking step's samples out by their global position, which only that "
                    f"loader knows (got a {type(train_loader).__name__})",
                    "Build the loader with s.loader(dataset, batch_size=...), or use remedy='skip'",
                )
            self.undo = Rollback(s, train_loader)
        self.emit("fit_start")
        state.model.train()
        try:
            with judge.acting(rolls_back=self.rollback) if judge is not None else nullcontext():
                while not self.done() and (self.plan.epochs is None or state.epoch < self.plan.epochs):
                    try:
                        self.epoch(train_loader)
                    except ReplicaDrift as drift:  # on every rank at the same step (an agreed verdict)
                        self.drifted(drift, train_loader)
                last_eval = state.evals[-1]["step"] if state.evals else None
                if (
                    self.plan.eval_loader is not None
                    and self.plan.eval_every is not None
                    and last_eval != state.step
                ):
                    self.evaluate()
        finally:
            if self.bar is not None:
                self.bar.close()
        self.emit("fit_end")
        return FitResult(
            steps=state.step,
            epochs=self.started_epochs,
            losses=state.losses,
            evals=state.evals,
            seconds=time.perf_counter() - self.start,
            stop_reason=state.stop_reason,
            skipped_steps=self.skipped,
            anatomy=self.monitor.summary(),
        )

    def epoch(self, train_loader: Iterable) -> None:
        s, state = self.s, self.state
        self.emit("epoch_start")
        self.started_epochs += 1
        state.epoch_losses = []
        local_loss = torch.zeros(2, dtype=torch.float64, device=s.device)  # [loss sum, non-finite count]
        batches = 0
        # a pass that starts part-way (a resume, a rollback) may find its epoch already read to the end: a
        # checkpoint saved at the epoch's last step, before the epoch's end ran (scheduler, eval, callbacks)
        resumed = isinstance(train_loader, ShardedLoader) and train_loader.position[1] > 0
        for batch in train_loader:
            self.mark("data")
            batches += 1
            if self.micro_batches % s.accumulation == 0:
                self.emit("step_start")
            self.micro_batches += 1
            if self.undo is not None:  # remedy="rollback": where this micro-batch's samples lie
                self.undo.mark()
            if self.micro_batch(batch, local_loss):
                local_loss.zero_()
                if self.undo is not None:
                    self.undo.clear()
                if self.rolled_back or self.done():
                    break
            self.mark("other")  # the loop's own work; next: the wait for the next batch
        if self.rolled_back:  # the pass restarts at the checkpoint's position (the caller's next call)
            self.rolled_back = False
            return
        if batches == 0 and not resumed:
            raise problem("the training loader yielded no batch in an epoch", "Pass a non-empty loader")
        if self.plan.scheduler is not None and self.plan.scheduler_interval == "epoch":
            self.plan.scheduler.step()
        if self.plan.eval_loader is not None and self.plan.eval_every is None:
            self.evaluate(again=resumed and batches == 0)
        self.emit("epoch_end")
        if s.any_rank(state.stop_reason is not None):
            state._agree_stop()
        state.epoch += 1

    def micro_batch(self, batch: object, local_loss: torch.Tensor) -> bool:
        """Forward and backward of one micro-batch; on the k-th, the optimizer step. True after a step."""
        s, state = self.s, self.state
        loss, micro = self.blocks.run(batch)  # its accumulate block(s); micro_batch="auto": oom_retry
        self.samples += batch_len(batch)
        value = loss.detach().double()
        finite = torch.isfinite(value)  # kept on the device: no host sync per micro-batch
        local_loss += torch.stack([torch.where(finite, value, 0.0), (~finite).double()])
        if not micro.sync:
            s.step(state.optimizer, max_norm=self.plan.max_norm)
            self.mark("optimizer")
            return False
        mean_loss = _agree(s, state, local_loss / s.accumulation)
        s.stepper.agree_loss(mean_loss)  # spike_guard=: judged on the agreed loss too (`ddpkit.step.spikes`)
        self.mark("other")
        info = s.step(state.optimizer, max_norm=self.plan.max_norm)
        self.mark("optimizer")
        self.monitor.anatomy.end_step()
        self.skipped += info.skipped  # the fp16 scaler's, the guard's (rolled back too), no valid token
        if info.spike is not None and info.spike.rollback and self.roll_back(info.spike):
            return True
        plan = self.plan
        counted = info.spike is None or info.spike.counted  # a spike skipped: SpikeGuard(count_skipped=)
        if (
            plan.scheduler is not None
            and plan.scheduler_interval == "step"
            and counted
            and (not info.skipped or info.spike is not None)
        ):
            plan.scheduler.step()  # not after a step the fp16 scaler skipped: the schedule follows updates
        state.step += counted  # this call's optimizer steps (s.stepper.steps counts the session's)
        if counted:  # a skip that does not count has no loss of its own: `losses` is one per counted step
            state.loss = mean_loss
            state.losses.append(mean_loss)
            state.epoch_losses.append(mean_loss)
        self.emit("step_end")
        self.after_step(mean_loss, info, counted)
        if (
            counted  # not again at the step number the last counted step was evaluated at
            and self.plan.eval_loader is not None
            and self.plan.eval_every is not None
            and state.step % self.plan.eval_every == 0
        ):
            self.evaluate()
        return True

    def roll_back(self, spike: Spike) -> bool:
        """Every rank (the spike is agreed): back to the session's last checkpoint, the step's samples
        left out (`ddpkit.training.rollback`); this call's counters, losses and evaluations follow it and
        the pass restarts at the checkpoint's position. False: there is none (the step stays skipped)."""
        undo = self.undo
        assert undo is not None  # set by run() whenever self.rollback
        needed = self.needed(undo.loader)
        back = undo.to_checkpoint(spike, needed)
        if back is None:
            return False
        self.take_back(back)
        self.rolled_back = True
        return True

    def needed(self, loader: ShardedLoader) -> dict[str, object]:
        """The objects a rollback's checkpoint must hold: those this call trains with."""
        state = self.state
        needed: dict[str, object] = {
            "model": state.model,
            "optimizer": state.optimizer,
            "stepper": self.s.stepper,
            "loader": loader,
        }
        if self.plan.scheduler is not None:
            needed["scheduler"] = self.plan.scheduler
        return needed

    def drifted(self, drift: ReplicaDrift, train_loader: Iterable) -> None:
        """Every rank, the same step: the replicas drifted (`ddpkit.step.fingerprint`). on_drift="rollback":
        back to the last checkpoint written while they agreed (`Rollback.to_agreed`), this call's counters
        following it; the caller's next pass restarts at the checkpoint's position."""
        if self.on_drift == "stop":
            raise drift
        if not isinstance(train_loader, ShardedLoader):
            raise not_rolled_back(
                drift,
                f"the training loader is a {type(train_loader).__name__}, whose position a checkpoint cannot "
                "restore. Build it with s.loader(dataset, batch_size=...)",
            )
        if self.drift_undo is None:
            self.drift_undo = self.undo if self.undo is not None else Rollback(self.s, train_loader)
        # a drift seen inside s.step comes before this call's counters took that step (one in a callback's
        # save, after): the session's count, which the checkpoint restores, says how far they lag
        pending = self.s.stepper.steps - self.offset - self.state.step
        back = self.drift_undo.to_agreed(drift, self.needed(train_loader))
        back = Undone(back.steps - pending, back.passes)
        if self.undo is not None:
            self.undo.clear()  # the abandoned step's samples
        self.take_back(back)
        self.monitor.anatomy.skip()  # the phases of the abandoned step

    def take_back(self, back: Undone) -> None:
        """This call's counters, losses and evaluations as at the checkpoint a rollback loaded."""
        state = self.state
        undone = back.steps
        state.step = max(0, state.step - undone)
        del state.losses[max(0, len(state.losses) - undone) :]
        state.evals[:] = [e for e in state.evals if e["step"] <= state.step]  # its later evaluations too
        state.epoch = max(0, state.epoch - back.passes)
        self.started_epochs -= back.passes + 1  # the restarted pass counts once
        self.micro_batches = self.samples = 0

    def counted(self, batch: object, weight: float) -> torch.Tensor:  # FLOPs counted at the first call
        return self.monitor.counting(lambda b: self.forward_backward(b, weight), batch)

    def forward_backward(self, batch: object, weight: float = 1.0) -> torch.Tensor:
        """train_step and s.backward, each inside the model's loss context (`Strategy.loss_context`:
        loss parallel's `loss_parallel()`, entered again for the backward in case a train_step entered
        and left it itself); the loss as a plain tensor (a DTensor's: replicated, read without a
        collective), which fit sums and all-reduces with plain tensors."""
        model = self.state.model
        context = self.s.strategy.loss_context
        with context(model):
            loss = self.plan.train_step(model, batch)
        self.mark("forward")
        with context(model):
            self.s.backward(loss if weight == 1.0 else loss * weight)
        self.mark("backward")
        full = getattr(loss, "full_tensor", None)  # a DTensor loss (loss parallel's cross entropy)
        return full() if full is not None else loss

    def after_step(self, mean_loss: float, info: StepInfo, counted: bool = True) -> None:
        """Throughput and step time; the log row, the trackers and the progress line. A skipped step that
        does not count (SpikeGuard(count_skipped=False)) reports nothing at the step number already
        reported: its samples and time go into the next counted step's throughput and step time."""
        s, state, plan = self.s, self.state, self.plan
        if not counted:
            self.monitor.after_step(s.stepper.steps)  # every rank, as after any step (a gather may be due)
            return
        now = time.perf_counter()
        step_s, self.last_step_end = now - self.last_step_end, now
        samples = self.samples * s.world_size  # the loader gives every rank the same batch size
        self.samples = 0
        self.rows.add(samples, step_s)
        self.tracked.add(samples, step_s)
        values = {"loss": mean_loss, "lr": state.optimizer.param_groups[0]["lr"]}
        if info.grad_norm is not None:
            values["grad_norm"] = float(info.grad_norm)
        monitor = self.monitor
        monitor.after_step(s.stepper.steps)  # every anatomy_every steps: one all_gather (every rank)
        if state.step % plan.log_every == 0:
            rates = self.rows.take()
            row = {
                "phase": "train",
                "step": state.step,
                "epoch": state.epoch,
                **values,
                **rates,
                **monitor.scalars(rates["step_time"], anatomy=False),
            }
            self.logger.write({**row, "seconds": round(now - self.start, 3)})
        if state.step % plan.track_every == 0:
            rates = self.tracked.take()
            s.log({**values, **rates, **monitor.scalars(rates["step_time"])}, step=s.stepper.steps)
        if self.bar is not None:
            self.bar.update(state.step, state.epoch, mean_loss, samples, monitor.detail)

    def evaluate(self, again: bool = False) -> None:
        s, state = self.s, self.state
        if again and state.evals and state.evals[-1]["step"] == state.step:  # a rollback re-ran an epoch end
            state.evals.pop()  # on the same weights: FitResult.evals keeps one entry per evaluation
        self.emit("eval_start")
        state.metrics = evaluate(s, state.model, self.plan.eval_loader, self.plan.eval_step, self.metric_set)  # type: ignore[arg-type]
        state.evals.append({"step": state.step, **state.metrics})
        row = {"phase": "eval", "step": state.step, "epoch": state.epoch, **state.metrics}
        self.logger.write({**row, "seconds": round(time.perf_counter() - self.start, 3)})
        s.log({f"eval/{k}": v for k, v in state.metrics.items()}, step=s.stepper.steps)
        self.emit("eval_end")
        if s.any_rank(state.stop_reason is not None):
            state._agree_stop()
        self.last_step_end = time.perf_counter()  # step time and throughput leave evaluation out
        self.monitor.anatomy.skip()  # and so do the phases


def _agree(s: Session, state: FitState, local: torch.Tensor) -> float:
    """One all-reduce before the optimizer step: who has a non-finite loss, who wants to stop, the loss.

    `local` is this rank's [mean loss over its finite micro-batches, share of non-finite ones].
    """
    w = s.world_size
    packed = torch.zeros(w + 2, dtype=torch.float64, device=s.device)
    packed[s.rank] = local[1]
    packed[w] = float(state.stop_reason is not None)
    packed[w + 1] = local[0]
    totals = s.all_reduce(packed).tolist()
    bad_ranks = [r for r in range(w) if totals[r] > 0]
    if bad_ranks:
        raise problem(
            f"the training loss is not finite (nan or inf) at optimizer step {state.step + 1} "
            f"(epoch {state.epoch}) on rank(s) {bad_ranks}; every rank stopped before applying that step, "
            f"so the weights are those after step {state.step}",
            "Lower the learning rate, clip gradients (max_norm=...), check the data that rank read, or "
            "use precision='32'",
        )
    if totals[w] > 0:
        state._agree_stop()
    return totals[w + 1] / w
