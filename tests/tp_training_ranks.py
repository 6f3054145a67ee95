"""Rank functions for the tensor-parallel training tests (tests/test_tp_training.py, test_tp_precision.py,
test_tp_sequence.py): the models and batches of tests/tp_ranks.py trained under a TP layout and in one
process with what a training loop adds on top of the plain step: loss parallel, token-weighted losses,
the spike guard's own norm, evaluation's sums, activation checkpointing, bf16 and compile."""

from __future__ import annotations

import contextlib
import io
from typing import Any

import torch
import torch.nn.functional as F
from tp_ranks import VOCAB, FeatureSplit, batches, dp_rank_of, full, make

import ddpkit
from ddpkit.strategy.checkpointing import plain_name
from ddpkit.strategy.tp_options import TPOptions


def labels_of(x: torch.Tensor) -> torch.Tensor:
    """Next-token labels with a different number of padded (-100) positions per row: rows of unequal
    token counts, so a mean of per-rank means is not the global token mean."""
    labels = torch.roll(x, -1, 1).clone()
    for row in range(len(labels)):
        labels[row, labels.shape[1] - 1 - int(x[row, 0]) % labels.shape[1] :] = -100  # by content
    return labels


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (DTensors gathered: a collective), by its name in `state_dict` (without
    wrappers: activation checkpointing's, compile's)."""
    return {plain_name(n): full(p) for n, p in ddpkit.unwrap(model).named_parameters()}


def loss_and_tokens(kind: str, model: torch.nn.Module, x: torch.Tensor, how: str) -> tuple[Any, Any]:
    """The step's loss (and its valid tokens for `how="tokens"`): a mean cross entropy, or the sum."""
    if kind == "mlp":
        return model(x).square().mean(), None
    if kind in ("llama", "lora"):
        out = model(input_ids=x, labels=x)
        return out.loss, None
    logits = model(x)
    if how == "tokens":
        labels = labels_of(x)
        total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
        return total, (labels != -100).sum()
    return F.cross_entropy(logits.flatten(0, 1), torch.roll(x, -1, 1).flatten()), None


def train_tp(
    kind: str,
    options: TPOptions | None,
    *,
    how: str = "mean",
    steps: int = 3,
    accumulation: int = 1,
    max_norm: float | None = 0.5,
    rows: int = 8,
    seq: int = 8,
    variant: str = "",
    model_kw: dict | None = None,
    session_kw: dict | None = None,
    wrap_kw: dict | None = None,
    evaluate: bool = False,
    sgd: bool = False,
) -> dict:
    """`steps` AdamW steps; `options` None: one process. `how`: "mean" (a mean loss), "parallel" (the
    loss and s.backward inside torch's loss_parallel(), under TP), "tokens" (summed losses with
    s.backward(loss, tokens=n)). `session_kw` / `wrap_kw`: ddpkit.session's and s.model's keywords
    (precision, spike_guard; activation_checkpointing, compile). `evaluate`: evaluation's sums over the
    batches after training. `sgd`: plain SGD instead of AdamW (whose first steps turn any rounding of
    a near-zero gradient into a whole update of the other sign: bf16's comparisons). Returns the weights after each step, the norms, the printed lines, the
    placements and the losses."""
    from torch.distributed.tensor.parallel import loss_parallel

    printed = io.StringIO()
    session: dict[str, Any] = dict(seed=0, accumulation=accumulation, **(session_kw or {}))
    if options is not None:
        session["strategy"] = options
    modes = {"features": FeatureSplit, "outputs": OutputSplit}
    mode = modes[variant]() if variant in modes else contextlib.nullcontext()
    with contextlib.redirect_stdout(printed), ddpkit.session(**session) as s, mode:
        model = s.model(lambda: make(kind, **(model_kw or {})), strategy=options, **(wrap_kw or {}))
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.SGD(params, lr=0.5) if sgd else torch.optim.AdamW(params, lr=3e-3)
        layout = s.layout
        dp, dp_rank = (layout.data, dp_rank_of(layout, s.rank)) if layout is not None else (1, 0)
        states, norms, losses, kinds, dtypes = [weights(model)], [], [], [], set()
        model.register_forward_hook(lambda _m, _a, out: dtypes.add(str(getattr(out, "dtype", type(out)))))
        for x in batches(kind, steps * accumulation, rows, seq):
            per = rows // dp
            mine = x[dp_rank * per : (dp_rank + 1) * per]
            if variant == "permuted":
                mine = mine[torch.randperm(len(mine), generator=torch.Generator().manual_seed(3))]
            parallel = (
                loss_parallel() if how == "parallel" and options is not None else contextlib.nullcontext()
            )
            with s.accumulate(model), parallel:
                loss, tokens = loss_and_tokens(kind, model, mine, how)
                kinds.append(type(loss).__name__)
                losses.append(
                    float(loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach())
                )
                s.backward(loss, tokens=tokens) if tokens is not None else s.backward(loss)
            info = s.step(opt, max_norm=max_norm)
            if info.stepped:
                states.append(weights(model))
                if info.grad_norm is not None:
                    norms.append(float(info.grad_norm))
        sums = evaluation_sums(s, model, kind, rows, seq) if evaluate else {}
        inner = ddpkit.unwrap(model)
        placements = {
            plain_name(n): [type(p).__name__ for p in t.placements]
            for n, t in inner.named_parameters()
            if hasattr(t, "placements")
        }
    return {
        "states": states,
        "norms": norms,
        "losses": losses,
        "loss_types": kinds,
        "output_dtypes": sorted(dtypes),
        "printed": printed.getvalue(),
        "placements": placements,
        "sums": sums,
        "layout": None if layout is None else layout.as_dict(),
        "graphs": graphs(),
    }


def graphs() -> dict[str, int]:
    """What torch.compile did in this process so far: graphs compiled, graph breaks, fallbacks to eager."""
    from torch._dynamo.utils import counters

    return {
        "graphs": sum(counters["stats"].values()) and counters["stats"]["unique_graphs"],
        "breaks": sum(counters["graph_break"].values()),
        "frames": counters["frames"]["ok"],
    }


def evaluation_sums(s: Any, model: torch.nn.Module, kind: str, rows: int, seq: int) -> dict[str, float]:
    """ddpkit.evaluate over 4 batches split by the data-parallel rank, as s.loader splits them: the sums
    of the rows, the valid tokens and the summed loss (Sum metrics), and the mean loss."""
    from ddpkit.observe.metrics import Mean, Sum

    g = torch.Generator().manual_seed(5)
    data = torch.utils.data.TensorDataset(torch.randint(0, VOCAB, (4 * rows, seq), generator=g))
    loader = s.loader(data, batch_size=rows, evaluation=True)

    def step(module: torch.nn.Module, batch: Any, metrics: Any) -> None:
        x = batch[0]
        logits = module(x)
        logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
        labels = labels_of(x)
        total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
        tokens = (labels != -100).sum()
        metrics["rows"].update(len(x))
        metrics["tokens"].update(tokens)
        metrics["loss_sum"].update(total)
        metrics["loss"].update(total / tokens, weight=float(tokens))

    metrics = {"rows": Sum(), "tokens": Sum(), "loss_sum": Sum(), "loss": Mean()}
    return ddpkit.evaluate(s, model, loader, step, metrics)


def refused_outside(options: TPOptions) -> str:
    """Loss parallel's refusal of a training forward outside loss_parallel(): the message."""
    try:
        with ddpkit.session(seed=0, verbose=False, strategy=options) as s:
            model = s.model(lambda: make("gpt"), strategy=options)
            x = batches("gpt", 1)[0]
            s.backward(F.cross_entropy(model(x).flatten(0, 1), torch.roll(x, -1, 1).flatten()))
        return "no error"
    except ddpkit.DdpkitError as err:
        return str(err)


class OutputSplit(torch.overrides.TorchFunctionMode):
    """A noise-floor variant for tensor parallelism's backward: every F.linear computed as 2 pieces of its
    output features, so the gradient of its input is summed from 2 pieces, as a column-wise layer's is
    over the tensor ranks (the features variant reorders the forward's sums, not this one)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear and args[1].shape[0] % 2 == 0:
            x, w = args[0], args[1]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            bs = b.chunk(2) if b is not None else (None, None)
            parts = [F.linear(x, wc, bc) for wc, bc in zip(w.chunk(2), bs, strict=True)]
            return torch.cat(parts, -1)
        return func(*args, **kwargs)


def refused_compile(options: TPOptions, model_kw: dict) -> str:
    """The GPT with `model_kw` (a dropout) compiled under TP: the refusal's message, or "no error"."""
    try:
        with ddpkit.session(seed=0, verbose=False, strategy=options) as s:
            s.model(lambda: make("gpt", **model_kw), strategy=options, compile={"backend": "eager"})
        return "no error"
    except ddpkit.DdpkitError as err:
        return str(err)
