"""Loss parallel: a vocabulary-sharded head's logits kept sharded, and the cross entropy computed on the
shards inside torch's `loss_parallel()`, so no rank ever holds the whole (batch x sequence x vocabulary)
logits: each holds vocabulary / tensor of them, and the softmax's maximum and sum are all-reduced over
the tensor ranks instead.

    s = ddpkit.session(strategy=TPOptions(tensor=2, loss_parallel=True))
    model = s.model(Net, strategy=TPOptions(plan={..., "lm_head": "colwise_gather_output"}, ...))
    with loss_parallel():                               # torch.distributed.tensor.parallel
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        s.backward(loss)                                # the backward inside the context too

    ddpkit.fit(s, model, opt, loader, step)             # or fit: it enters the context itself (`entered`)

What ddpkit adds to torch's context: with `TPOptions(loss_parallel=True)` the head's style (a Hugging Face
model's `lm_head: colwise_gather_output`, or the same name in a user's plan) leaves its output a DTensor
sharded on the vocabulary (`head_style`) instead of gathering it; a plan with no such head is refused
before any collective (`heads`); and a training forward outside `loss_parallel()` is refused in one
paragraph (`guard`), where torch would fail later inside the loss in its own words. The head's model is
marked with the context its step needs (`Strategy.loss_context`), so that `fit` runs its train_step and
s.backward, and `evaluate` its eval_step, inside `loss_parallel()` without knowing of tensor parallelism.

What torch's `loss_parallel()` cannot do, and torch refuses itself: a loss other than cross entropy /
negative log-likelihood on the sharded logits (any other op gathers them, or fails on mixing a DTensor
with a plain tensor), `label_smoothing`, class-probability targets. ddpkit does not shard the logits
over the data ranks, so reduction "mean", "sum" and "none" all work (the logits live on the 1-D tensor
mesh).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from ddpkit.errors import problem
from ddpkit.strategy.base import LOSS_CONTEXT

HEAD_STYLE = "colwise_gather_output"  # the name Hugging Face gives a head that gathers its logits


def head_style(input_layout: Any) -> Any:
    """The head under loss parallel: split column-wise (its rows are the vocabulary), its output left
    a DTensor sharded on the last dimension (the vocabulary) rather than gathered."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    return ColwiseParallel(input_layouts=input_layout, output_layouts=Shard(-1), use_local_output=False)


def vocabulary_sharded(style: Any) -> bool:
    """A column-wise style whose output stays a DTensor sharded on its last dimension."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    if not isinstance(style, ColwiseParallel) or style.use_local_output:
        return False
    out = style.output_layouts[0]
    return isinstance(out, Shard) and out.dim == -1


def heads(model: nn.Module, found: dict[str, str], plan: dict[str, Any]) -> list[str]:
    """The layers whose logits stay sharded over the vocabulary; none is refused (loss parallel would
    have nothing to run on: the loss would silently see gathered logits)."""
    names = [n for n, p in found.items() if vocabulary_sharded(plan[p])]
    if not names:
        raise problem(
            f"TPOptions(loss_parallel=True), but the plan of the {type(model).__name__} splits no head "
            "over the vocabulary, so there are no sharded logits to compute the loss on",
            f"Give the output layer the style {HEAD_STYLE!r} (a Hugging Face model's lm_head has it), or "
            "torch's ColwiseParallel(use_local_output=False) (output sharded on the last dimension); or "
            "leave loss_parallel=False",
        )
    return names


def active() -> bool:
    """Whether torch's `loss_parallel()` context is entered (its custom cross-entropy handlers are in
    DTensor's dispatcher)."""
    import torch
    from torch.distributed.tensor import DTensor

    handlers = getattr(getattr(DTensor, "_op_dispatcher", None), "_custom_op_handlers", {})
    return torch.ops.aten._log_softmax.default in handlers


@contextlib.contextmanager
def entered() -> Iterator[None]:
    """torch's `loss_parallel()`, unless it is entered already; left only if still entered at the end.
    torch's context is not re-entrant (its exit removes the handlers, a second removal fails) and does
    not leave on an error: a train_step that enters it itself, inside fit's, keeps working (fit enters
    this again for the backward), and an error inside leaves no handler behind."""
    from torch.distributed.tensor.parallel import loss_parallel

    if active():
        yield
        return
    context = loss_parallel()
    context.__enter__()
    try:
        yield
    finally:
        if active():
            context.__exit__(None, None, None)


def guard(model: nn.Module, names: list[str]) -> None:
    """Each head refuses, in one paragraph, a training forward outside `loss_parallel()`: the cross
    entropy on its sharded logits would fail inside torch (a sharded DTensor mixed with plain targets).
    Evaluation (no gradients) may read the logits anywhere. A backward outside the context fails in
    torch's own words ("aten.nll_loss_backward.default got mixed torch.Tensor and DTensor"): its first
    op is the loss's, which no hook of the model's sees before it runs."""
    import torch

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        if module.training and torch.is_grad_enabled() and not active():
            raise problem(
                "the logits are sharded over the vocabulary (TPOptions(loss_parallel=True)) but the "
                "training forward ran outside torch's loss_parallel() context: the cross entropy on them "
                "would fail inside torch (a sharded DTensor mixed with plain targets)",
                "Run the forward, the loss and s.backward(loss) inside `with loss_parallel():` (from "
                "torch.distributed.tensor.parallel), or train with ddpkit.fit, which enters it; evaluation "
                "without gradients may read the logits outside it (logits.full_tensor()); or set "
                "loss_parallel=False to gather the logits",
            )

    for name in names:
        model.get_submodule(name).register_forward_hook(hook)
    if names:  # fit's step and evaluation run inside loss_parallel() (`Strategy.loss_context`)
        setattr(model, LOSS_CONTEXT, entered)
