"""The fit loop on gloo: step budget over epochs with accumulation, evaluation every N steps, scheduler,
callbacks in order, rank-0 logs, a non-finite loss stopping every rank with one message, and a stop
request from one rank ending the run on all."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.errors import DdpkitError
from ddpkit.observe.metrics import Accuracy, Mean
from ddpkit.training.fit import Callback, FitState, fit


def _data(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))


def _train_step(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def _eval_step(model: nn.Module, batch, metrics) -> None:
    x, y = batch
    out = model(x)
    metrics["accuracy"].update(out, y)
    metrics["loss"].update(nn.functional.cross_entropy(out, y, reduction="none"))


class Recorder(Callback):
    def __init__(self) -> None:
        self.events: list[str] = []

    def __getattribute__(self, name: str):
        if name.startswith("on_"):
            return lambda state: self.events.append(f"{name[3:]}@{state.step}")
        return super().__getattribute__(name)


def fit_run(log: str) -> dict:
    with ddpkit.session(seed=0, accumulation=2, verbose=False) as s:
        model = s.model(_net())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        recorder = Recorder()
        result = fit(
            s,
            model,
            opt,
            s.loader(_data(), batch_size=16, shuffle=True),
            _train_step,
            max_steps=10,
            eval_loader=s.loader(_data(), batch_size=32, evaluation=True),
            eval_step=_eval_step,
            metrics={"accuracy": Accuracy(), "loss": Mean()},
            eval_every=4,
            scheduler=torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5),
            callbacks=[recorder],
            log=log,
            progress=True,
        )
        return {"result": result, "events": recorder.events, "lr": opt.param_groups[0]["lr"]}


@pytest.mark.parametrize("suffix", ["jsonl", "csv"])
def test_fit_budget_evaluation_scheduler_callbacks_and_logs(suffix: str, pool2, tmp_path: Path) -> None:
    log = tmp_path / f"run/log.{suffix}"
    r0, r1 = pool2.run(fit_run, str(log))
    res = r0["result"]
    assert (res.steps, res.epochs) == (10, 3)  # 64 samples / 16 per step: 4 steps per epoch
    assert res.losses == r1["result"].losses and len(res.losses) == 10
    assert [e["step"] for e in res.evals] == [4, 8, 10] and res.evals == r1["result"].evals
    assert 0.0 < res.evals[-1]["accuracy"] <= 1.0 and res.stop_reason is None
    assert r0["lr"] == pytest.approx(0.1 * 0.5**3)
    events = r0["events"]
    assert events[:3] == ["fit_start@0", "epoch_start@0", "step_start@0"]
    assert events[3:8] == ["step_end@1", "step_start@1", "step_end@2", "step_start@2", "step_end@3"]
    assert "step_end@4" in events and events[
        events.index("step_end@4") + 1 : events.index("step_end@4") + 3
    ] == [
        "eval_start@4",
        "eval_end@4",
    ]
    assert events[-3:] == ["eval_start@10", "eval_end@10", "fit_end@10"] and events == r1["events"]
    if suffix == "jsonl":
        rows = [json.loads(line) for line in log.read_text().splitlines()]
    else:
        rows = list(csv.DictReader(log.open()))
    assert [int(r["step"]) for r in rows if r["phase"] == "train"] == list(range(1, 11)), "rank 0 only, once"
    assert [int(r["step"]) for r in rows if r["phase"] == "eval"] == [4, 8, 10]
    assert {"phase", "step", "epoch", "loss", "lr", "seconds"} <= set(rows[0])
    assert {"phase", "step", "epoch", "accuracy", "loss", "seconds"} <= set(rows[-1])


def non_finite() -> str:
    with ddpkit.session(seed=0, verbose=False) as s:
        model = s.model(_net())
        seen = [0]

        def poisoned(model: nn.Module, batch) -> torch.Tensor:
            seen[0] += 1
            loss = _train_step(model, batch)
            return loss * math.nan if (s.rank == 1 and seen[0] == 6) else loss

        try:
            fit(
                s,
                model,
                torch.optim.SGD(model.parameters(), lr=0.1),
                s.loader(_data(), batch_size=8, shuffle=True),
                poisoned,
                epochs=3,
                progress=False,
            )
        except DdpkitError as exc:
            return str(exc)
        return "finished"


def test_non_finite_loss_stops_every_rank_naming_step_and_rank(pool2) -> None:
    r0, r1 = pool2.run(non_finite, timeout=30)
    assert r0 == r1
    assert r0.startswith(
        "the training loss is not finite (nan or inf) at optimizer step 6 (epoch 0) on rank(s) [1]"
    )
    assert "weights are those after step 5" in r0 and "Lower the learning rate" in r0


class StopOnRank1(Callback):
    def on_step_end(self, state: FitState) -> None:
        if state.s.rank == 1 and state.step == 3:
            state.request_stop("rank 1 had enough")


def stop_request() -> dict:
    with ddpkit.session(seed=0, verbose=False) as s:
        model = s.model(_net())
        result = fit(
            s,
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            s.loader(_data(), batch_size=8, shuffle=True),
            _train_step,
            epochs=5,
            callbacks=[StopOnRank1()],
            progress=False,
        )
        return {"steps": result.steps, "reason": result.stop_reason}


def test_a_stop_request_on_one_rank_stops_all_ranks_together(pool2) -> None:
    r0, r1 = pool2.run(stop_request, timeout=30)
    assert r0["steps"] == r1["steps"] == 4  # agreed in the next step's all-reduce
    assert r1["reason"] == "rank 1 had enough" and r0["reason"] == "requested by a callback on another rank"


def test_one_process_fit_and_configuration_errors(tmp_path: Path, capsys) -> None:
    with ddpkit.session(seed=0, verbose=False, env={}, hardware=ddpkit.Hardware(0, 2)) as s:
        model = s.model(_net())
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        loader = s.loader(_data(), batch_size=16, shuffle=True)
        with pytest.raises(DdpkitError, match=r"fit needs a budget. Pass epochs=N, max_steps=N"):
            fit(s, model, opt, loader, _train_step)
        with pytest.raises(DdpkitError, match=r"eval_loader, eval_step and metrics together"):
            fit(s, model, opt, loader, _train_step, epochs=1, eval_loader=loader)
        result = fit(
            s,
            model,
            opt,
            loader,
            _train_step,
            epochs=3,
            log=tmp_path / "log.csv",
            eval_loader=s.loader(_data(), batch_size=64, evaluation=True),
            eval_step=_eval_step,
            metrics={"accuracy": Accuracy(), "loss": Mean()},
            progress=False,
        )
    assert result.steps == 12 and [e["step"] for e in result.evals] == [4, 8, 12]
    assert result.evals[-1]["accuracy"] > 0.8 and result.losses[-1] < result.losses[0]
    assert capsys.readouterr().out == ""  # quiet: the user's callbacks decide what is printed
