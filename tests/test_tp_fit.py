"""`ddpkit.fit` under tensor parallelism with loss parallel, on gloo ranks against fit in one process: fit
runs the train_step and s.backward inside torch's loss_parallel(), and its evaluation's eval_step too, so
a cross entropy on the vocabulary-sharded logits works in both without the user entering the context; a
train_step that enters it itself keeps working (torch's context is not re-entrant). The spike guard
judges fit's agreed loss there as anywhere."""

from __future__ import annotations

import contextlib
import io
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tp_ranks import GPT_VOCAB_PLAN, VOCAB, batches, excess, make
from tp_training_ranks import train_tp, weights

import ddpkit
from ddpkit.observe.metrics import Mean, Sum
from ddpkit.strategy.tp_options import TPOptions

pytestmark = pytest.mark.numerics  # compared with one process: the default-kernel leg runs it too

STEPS, ROWS = 3, 8


def _eval_step(seen: list[str]) -> Any:
    def step(module: torch.nn.Module, batch: Any, metrics: Any) -> None:
        x = batch[0]
        logits = module(x)  # under loss parallel: a DTensor sharded on the vocabulary
        seen.append(type(logits).__name__)
        total = F.cross_entropy(logits.flatten(0, 1), torch.roll(x, -1, 1).flatten(), reduction="sum")
        total = total.full_tensor() if hasattr(total, "full_tensor") else total  # replicated: no collective
        metrics["loss"].update(total / x.numel(), weight=float(x.numel()))
        metrics["tokens"].update(x.numel())

    return step


def fit_gpt(options: TPOptions | None) -> dict:
    """fit over the batches train_tp takes (the same seeds, steps and global batch), an evaluation at the
    end, under the spike guard; the weights after each step, what the train_step saw of the logits, and a
    second fit of one step whose train_step enters loss_parallel() itself."""
    from torch.distributed.tensor.parallel import loss_parallel

    printed, seen, evaluated = io.StringIO(), [], []
    guard = ddpkit.SpikeGuard(warmup=2, window=4)
    session: dict[str, Any] = dict(seed=0, spike_guard=guard)
    if options is not None:
        session["strategy"] = options
    with contextlib.redirect_stdout(printed), ddpkit.session(**session) as s:
        model = s.model(lambda: make("gpt"), strategy=options)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        train = torch.utils.data.TensorDataset(torch.cat(batches("gpt", STEPS, ROWS)))
        g = torch.Generator().manual_seed(5)
        held = torch.utils.data.TensorDataset(torch.randint(0, VOCAB, (4 * ROWS, 8), generator=g))

        def step(m: torch.nn.Module, batch: Any) -> torch.Tensor:
            x = batch[0]
            logits = m(x)
            local = logits.to_local() if hasattr(logits, "to_local") else logits
            seen.append((type(logits).__name__, str(getattr(logits, "placements", "")), local.shape[-1]))
            return F.cross_entropy(logits.flatten(0, 1), torch.roll(x, -1, 1).flatten())

        states = [weights(model)]

        class Keep(ddpkit.Callback):
            def on_step_end(self, state: Any) -> None:
                states.append(weights(model))  # every rank (gathers DTensors)

        result = ddpkit.fit(
            s,
            model,
            opt,
            s.loader(train, batch_size=ROWS),
            step,
            epochs=1,
            max_norm=0.5,
            eval_loader=s.loader(held, batch_size=ROWS, evaluation=True),
            eval_step=_eval_step(evaluated),
            metrics={"loss": Mean(), "tokens": Sum()},
            callbacks=[Keep()],
            progress=False,
        )

        def own_context(m: torch.nn.Module, batch: Any) -> torch.Tensor:
            with loss_parallel():  # left before fit's backward: fit enters it again there
                return step(m, batch)

        again = ddpkit.fit(
            s, model, opt, s.loader(train, batch_size=ROWS), own_context, max_steps=1, progress=False
        )
        assert s.stepper.spikes is not None
        judged = {name: list(values) for name, values in s.stepper.spikes.windows.items()}
    return {
        "states": states,
        "losses": result.losses,
        "evals": result.evals,
        "seen": seen,
        "evaluated": sorted(set(evaluated)),
        "again": again.losses,
        "judged": judged,
        "printed": printed.getvalue(),
    }


def test_fit_runs_loss_parallel_for_the_step_and_the_evaluation_as_one_process(pool2) -> None:
    options = TPOptions(tensor=2, plan=GPT_VOCAB_PLAN, min_block_params=1, loss_parallel=True)
    ranks = pool2.run(fit_gpt, options, timeout=240)
    got = ranks[0]
    assert "loss parallel: the logits of lm_head stay sharded" in got["printed"], got["printed"]
    # the feature was active: the train_step saw the logits as shards of half the vocabulary
    assert got["seen"][:STEPS] == [("DTensor", "(Shard(dim=2),)", VOCAB // 2)] * STEPS, got["seen"]
    assert got["evaluated"] == ["DTensor"]  # evaluation's cross entropy on the sharded logits too
    ref = fit_gpt(None)
    assert ref["seen"][0][0] == "Tensor"
    variants = [train_tp("gpt", None, variant=v)["states"] for v in ("permuted", "features")]
    assert len(got["states"]) == len(ref["states"]) == STEPS + 1
    used, where = excess(ref["states"], got["states"], variants)
    assert used <= 1.0, f"{used:.2f} x verify's tolerance at {where}"
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert [e["step"] for e in got["evals"]] == [STEPS]
    assert got["evals"][0]["tokens"] == ref["evals"][0]["tokens"] == 4 * ROWS * 8  # the batch once per group
    assert got["evals"][0]["loss"] == pytest.approx(ref["evals"][0]["loss"], rel=1e-5)
    assert len(got["again"]) == 1 and got["again"] == pytest.approx(ref["again"], rel=1e-5)
    assert ranks[1]["losses"] == got["losses"] and ranks[1]["evals"] == got["evals"]
    # the spike guard judged fit's agreed loss (a float from the DTensor loss), the same on every rank
    assert got["judged"]["loss"] == got["losses"] + got["again"] == ranks[1]["judged"]["loss"]
    assert got["judged"]["loss"] == pytest.approx(ref["judged"]["loss"], rel=1e-5)
