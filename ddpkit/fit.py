"""An optional training loop, written on ddpkit's public API: `fit(s, model, opt, loader, train_step)`.

    on_fit_start
    for each epoch (up to `epochs`, or until `max_steps` optimizer steps):
        on_epoch_start
        for batch in train_loader:                       # one micro-batch; k of them per optimizer step
            on_step_start                                # before the first micro-batch of a step
            with s.accumulate(model):
                s.backward(train_step(model, batch))
            on the k-th micro-batch, ONE all-reduce of [non-finite flag per rank, stop request, loss]:
                a non-finite loss on any rank -> DdpkitError on every rank, naming the step and rank(s),
                before the optimizer applies it
            s.step(opt, max_norm) -> scheduler.step() -> on_step_end -> log row, progress bar
            every `eval_every` steps: on_eval_start -> evaluate -> on_eval_end
            a stop request (any rank, from a callback) ends the run after this step
        eval_every=None: on_eval_start -> evaluate -> on_eval_end at the end of the epoch
        on_epoch_end
    on_fit_end

Every decision that ends a loop is taken from all-reduced values, so all ranks leave together and
nobody waits in a collective the others never reach. Evaluation runs on the unwrapped module: DDP's
forward may broadcast buffers (a collective), and evaluation shards may differ by one batch. Under
FSDP the forward itself all-gathers, so the ranks evaluate in lockstep (`_in_lockstep`).
Rank 0 alone shows the progress bar (tqdm) and writes the log (`.jsonl` or `.csv`).
"""

from __future__ import annotations

import csv
import json
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ddpkit.errors import problem
from ddpkit.metrics import Metric, MetricSet
from ddpkit.session import Session

TrainStep = Callable[[nn.Module, Any], torch.Tensor]
EvalStep = Callable[[nn.Module, Any, MetricSet], None]


@dataclass
class FitState:
    """What callbacks see. `request_stop(reason)` ends the run after the current step, on every rank."""

    s: Session
    model: nn.Module
    optimizer: torch.optim.Optimizer
    epoch: int = 0
    step: int = 0  # optimizer steps done in this fit call
    loss: float = math.nan  # the last step's loss, mean over ranks and micro-batches
    epoch_losses: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)  # every step's loss
    metrics: dict[str, float] = field(default_factory=dict)  # the last evaluation
    evals: list[dict[str, float]] = field(default_factory=list)  # every evaluation, with its "step"
    stop_reason: str | None = None  # set by request_stop on this rank, or when another rank asked
    stopping: bool = False  # all ranks agreed to stop (in a collective): the loop ends after this step

    def request_stop(self, reason: str = "requested by a callback") -> None:
        self.stop_reason = reason

    def _agree_stop(self) -> None:
        self.stopping = True
        self.stop_reason = self.stop_reason or "requested by a callback on another rank"


class Callback:
    """Override any of these; each gets the `FitState`. They run on every rank."""

    def on_fit_start(self, state: FitState) -> None: ...
    def on_fit_end(self, state: FitState) -> None: ...
    def on_epoch_start(self, state: FitState) -> None: ...
    def on_epoch_end(self, state: FitState) -> None: ...
    def on_step_start(self, state: FitState) -> None: ...
    def on_step_end(self, state: FitState) -> None: ...
    def on_eval_start(self, state: FitState) -> None: ...
    def on_eval_end(self, state: FitState) -> None: ...


@dataclass(frozen=True)
class FitResult:
    steps: int
    epochs: int  # epochs started
    losses: list[float]  # per optimizer step, mean over ranks
    evals: list[dict[str, float]]
    seconds: float
    stop_reason: str | None
    skipped_steps: int  # fp16 steps skipped for inf/nan gradients


def evaluate(
    s: Session,
    model: nn.Module,
    loader: Iterable,
    eval_step: EvalStep,
    metrics: MetricSet | Mapping[str, Metric],
) -> dict[str, float]:
    """Run `eval_step(module, batch, metrics)` over `loader` without gradients; the synced metrics.

    Use a loader made with `s.loader(..., evaluation=True)` so every sample counts exactly once.
    """
    metric_set = metrics if isinstance(metrics, MetricSet) else MetricSet(s, **metrics)
    metric_set.reset()
    module = s.strategy.eval_module(model)
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad(), s.autocast():
            if s.strategy.collective_forward and s.distributed:
                _in_lockstep(s, module, loader, eval_step, metric_set)
            else:
                for batch in loader:
                    eval_step(module, batch, metric_set)
    finally:
        module.train(was_training)
    return metric_set.compute()


def _in_lockstep(
    s: Session, module: nn.Module, loader: Iterable, eval_step: EvalStep, metrics: MetricSet
) -> None:
    """Evaluate a model whose forward is a collective (FSDP): every rank runs as many forwards as the
    rank with the most batches; a rank out of batches repeats its last one into scratch metrics."""
    scratch = MetricSet(s, **{n: type(m)() for n, m in metrics.metrics.items()})
    batches, last = iter(loader), None
    while True:
        batch = next(batches, None)
        if s.all_ranks(batch is None):
            return
        if batch is not None:
            eval_step(module, batch, metrics)
            last = batch
        elif last is None:
            raise problem(
                f"rank {s.rank} has no evaluation batch while others do; under FSDP every rank must run "
                "the forward",
                "Use an evaluation set with at least one batch per rank",
            )
        else:
            eval_step(module, last, scratch)


class _Log:
    """Rows to a JSON-lines or CSV file, written by global rank 0 only."""

    def __init__(self, path: str | os.PathLike | None, enabled: bool) -> None:
        self.path = None if path is None or not enabled else os.fspath(path)
        self.rows: list[dict[str, Any]] = []
        self.columns: list[str] = []
        if self.path is None:
            return
        if not self.path.endswith((".jsonl", ".json", ".csv")):
            raise problem(f"log={self.path!r} has no .jsonl or .csv suffix", "Name it e.g. run/log.jsonl")
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        open(self.path, "w").close()

    def write(self, row: dict[str, Any]) -> None:
        if self.path is None:
            return
        if not self.path.endswith(".csv"):
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
            return
        self.rows.append(row)
        new = [k for k in row if k not in self.columns]
        self.columns += new
        with open(self.path, "w" if new else "a", newline="") as f:  # a new column rewrites the file
            writer = csv.DictWriter(f, fieldnames=self.columns)
            if new:
                writer.writeheader()
                writer.writerows(self.rows)
            else:
                writer.writerow(row)


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
    progress: bool = True,
) -> FitResult:
    """Train `model` (from `s.model`) with `train_step(model, batch) -> loss`; see the module docstring.

    Stops after `epochs` passes or `max_steps` optimizer steps, whichever comes first. Evaluation
    (`eval_step(module, batch, metrics)` over `eval_loader`) runs every `eval_every` optimizer steps,
    or at the end of each epoch when `eval_every` is None. `scheduler` steps after each optimizer step
    (`scheduler_interval="step"`) or each epoch ("epoch").
    """
    _check(epochs, max_steps, eval_loader, eval_step, metrics, eval_every, scheduler_interval, log_every)
    metric_set = MetricSet(s, **(metrics or {}))
    state = FitState(s, model, optimizer)
    logger = _Log(log, s.is_main)
    k = s.accumulation
    total = _total_steps(train_loader, epochs, max_steps, k)
    bar = _progress(total, enabled=progress and s.is_main)
    start = time.perf_counter()
    started_epochs = micro_batches = 0
    skipped_before = s.skipped_steps

    def emit(name: str) -> None:
        for cb in callbacks:
            getattr(cb, f"on_{name}")(state)

    def run_eval() -> None:
        emit("eval_start")
        state.metrics = evaluate(s, model, eval_loader, eval_step, metric_set)  # type: ignore[arg-type]
        state.evals.append({"step": state.step, **state.metrics})
        row = {"phase": "eval", "step": state.step, "epoch": state.epoch, **state.metrics}
        logger.write({**row, "seconds": round(time.perf_counter() - start, 3)})
        emit("eval_end")
        if s.any_rank(state.stop_reason is not None):
            state._agree_stop()

    def done() -> bool:  # from agreed values only: every rank gives the same answer
        return state.stopping or (max_steps is not None and state.step >= max_steps)

    emit("fit_start")
    model.train()
    try:
        while not done() and (epochs is None or state.epoch < epochs):
            emit("epoch_start")
            started_epochs += 1
            state.epoch_losses = []
            local_loss = torch.zeros(2, dtype=torch.float64, device=s.device)  # [loss sum, non-finite count]
            batches = 0
            for batch in train_loader:
                batches += 1
                if micro_batches % k == 0:
                    emit("step_start")
                micro_batches += 1
                with s.accumulate(model) as micro:
                    loss = train_step(model, batch)
                    s.backward(loss)
                value = loss.detach().double()
                finite = torch.isfinite(value)  # kept on the device: no host sync per micro-batch
                local_loss += torch.stack([torch.where(finite, value, 0.0), (~finite).double()])
                if not micro.sync:
                    s.step(optimizer, max_norm=max_norm)
                    continue
                mean_loss = _agree(s, state, local_loss / k)
                local_loss = torch.zeros_like(local_loss)
                info = s.step(optimizer, max_norm=max_norm)
                if scheduler is not None and scheduler_interval == "step" and not info.skipped:
                    scheduler.step()  # not after a step the fp16 scaler skipped: the schedule follows updates
                state.step += 1  # this call's optimizer steps (s.stepper.steps counts the session's)
                state.loss = mean_loss
                state.losses.append(mean_loss)
                state.epoch_losses.append(mean_loss)
                emit("step_end")
                if state.step % log_every == 0:
                    row = {"phase": "train", "step": state.step, "epoch": state.epoch, "loss": mean_loss}
                    row["lr"] = optimizer.param_groups[0]["lr"]
                    if info.grad_norm is not None:
                        row["grad_norm"] = float(info.grad_norm)
                    logger.write({**row, "seconds": round(time.perf_counter() - start, 3)})
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(epoch=state.epoch, loss=f"{mean_loss:.4f}")
                if eval_loader is not None and eval_every is not None and state.step % eval_every == 0:
                    run_eval()
                if done():
                    break
            if batches == 0:
                raise problem("the training loader yielded no batch in an epoch", "Pass a non-empty loader")
            if scheduler is not None and scheduler_interval == "epoch":
                scheduler.step()
            if eval_loader is not None and eval_every is None:
                run_eval()
            emit("epoch_end")
            if s.any_rank(state.stop_reason is not None):
                state._agree_stop()
            state.epoch += 1
        last_eval = state.evals[-1]["step"] if state.evals else None
        if eval_loader is not None and eval_every is not None and last_eval != state.step:
            run_eval()
    finally:
        if bar is not None:
            bar.close()
    emit("fit_end")
    return FitResult(
        steps=state.step,
        epochs=started_epochs,
        losses=state.losses,
        evals=state.evals,
        seconds=time.perf_counter() - start,
        stop_reason=state.stop_reason,
        skipped_steps=s.skipped_steps - skipped_before,
    )


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


def _check(epochs, max_steps, eval_loader, eval_step, metrics, eval_every, interval, log_every) -> None:
    if epochs is None and max_steps is None:
        raise problem("fit needs a budget", "Pass epochs=N, max_steps=N, or both (whichever comes first)")
    for name, value in (("epochs", epochs), ("max_steps", max_steps), ("eval_every", eval_every)):
        if value is not None and value < 1:
            raise problem(f"{name}={value} is below 1", f"Pass {name}=1 or more, or leave it out")
    if log_every < 1:
        raise problem(f"log_every={log_every} is below 1", "Pass 1 or more")
    if (eval_loader is None) != (eval_step is None) or (eval_loader is not None and not metrics):
        raise problem(
            "evaluation needs eval_loader, eval_step and metrics together",
            "Pass all three (e.g. metrics={'accuracy': Accuracy()}), or none of them",
        )
    if interval not in ("step", "epoch"):
        raise problem(f"scheduler_interval={interval!r} is not 'step' or 'epoch'", "Pass one of those")


def _total_steps(loader: Iterable, epochs: int | None, max_steps: int | None, k: int) -> int | None:
    try:
        per_epoch = len(loader)  # type: ignore[arg-type]
    except TypeError:
        return max_steps
    by_epochs = None if epochs is None else per_epoch * epochs // k
    known = [n for n in (by_epochs, max_steps) if n is not None]
    return min(known) if known else None


def _progress(total: int | None, *, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="fit", unit="step", leave=False, dynamic_ncols=True, mininterval=0.5)
