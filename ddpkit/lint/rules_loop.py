"""Rules about the training loop: DDP003 (a summed loss), DDP005 (a sampler never told the epoch)."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ddpkit.lint.rule import Rule
from ddpkit.lint.script import Script, is_const, kwarg, last, unparse

Found = Iterator[tuple[ast.AST, str]]
_LOSS_FUNCTIONS = (
    "cross_entropy",
    "nll_loss",
    "mse_loss",
    "l1_loss",
    "smooth_l1_loss",
    "huber_loss",
    "kl_div",
    "binary_cross_entropy",
    "binary_cross_entropy_with_logits",
    "poisson_nll_loss",
    "gaussian_nll_loss",
    "cosine_embedding_loss",
    "margin_ranking_loss",
    "hinge_embedding_loss",
    "triplet_margin_loss",
    "ctc_loss",
)


def _is_loss_fn(script: Script, call: ast.Call) -> bool:
    name = script.callee(call)
    return last(name) in _LOSS_FUNCTIONS or (name.startswith("torch.nn.") and last(name).endswith("Loss"))


def _criteria(script: Script) -> dict[str, ast.Call]:
    """Loss objects built in the file, by the text that names them: `criterion = nn.MSELoss(...)`."""
    out: dict[str, ast.Call] = {}
    for node in ast.walk(script.tree):
        call = node.value if isinstance(node, ast.Assign) else None
        if (
            isinstance(node, ast.Assign)
            and isinstance(call, ast.Call)
            and last(script.callee(call)).endswith("Loss")
        ):
            out.update({unparse(t): call for t in node.targets})  # call is node.value
    return out


def _sums(script: Script, call: ast.Call) -> ast.expr | None:
    """The `"sum"` of `reduction="sum"` (also inside `**options`), or None."""
    value = script.keyword(call, "reduction")
    return value if is_const(value, "sum") else None


def _lossy(script: Script, node: ast.AST, criteria: dict[str, ast.Call], depth: int = 0) -> bool:
    """Is `node` a loss (a loss function's or criterion's value, an error term, a `loss` name), also
    through the names it is computed from? A sum of model outputs or of weights (a penalty, equal on
    every rank) is not."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call) and (_is_loss_fn(script, sub) or unparse(sub.func) in criteria):
            return True
        if isinstance(sub, ast.BinOp) and isinstance(sub.op, ast.Sub):
            return True
        if isinstance(sub, ast.Name) and "loss" in sub.id.lower():
            return True
        if isinstance(sub, ast.Name) and depth < 3:
            value = script.value_of(sub)
            if value is not sub and _lossy(script, value, criteria, depth + 1):  # type: ignore[arg-type]
                return True
    return False


def _sum_site(script: Script, node: ast.AST, criteria: dict[str, ast.Call], depth: int = 0) -> ast.AST | None:
    """Where the loss `node` is summed (the `.sum()`, the `reduction="sum"`), following the file's
    own loss functions (`return (err + kld).sum()`); None when it is not a sum."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        for a, b in ((node.left, node.right), (node.right, node.left)):
            site = _sum_site(script, b, criteria, depth) if isinstance(a, ast.Constant) else None
            if site is not None:
                return site
        return None
    if not isinstance(node, ast.Call):
        return None
    f = node.func
    if isinstance(f, ast.Attribute) and f.attr == "sum" and not node.args and not node.keywords:
        return node if _lossy(script, f.value, criteria) else None
    if script.callee(node) == "torch.sum" and len(node.args) == 1 and not node.keywords:
        return node if _lossy(script, node.args[0], criteria) else None
    if _is_loss_fn(script, node):
        return _sums(script, node)
    crit = criteria.get(unparse(f))
    if crit is not None:
        return _sums(script, crit)
    if isinstance(f, ast.Name) and depth < 3:
        for fn in script.functions.get(f.id, []):
            for ret in ast.walk(fn):
                if isinstance(ret, ast.Return) and ret.value is not None and script.scope(ret) is fn:
                    site = _sum_site(script, script.value_of(ret.value), criteria, depth + 1)  # type: ignore[arg-type]
                    if site is not None:
                        return site
    return None


def _grads_reduced_by_hand(script: Script, scope: ast.AST, depth: int = 0) -> bool:
    """An all_reduce of gradients in this function or a file-local helper it calls
    (`dist.all_reduce(p.grad)`, or inside a loop over parameters): the user chose the arithmetic.
    An all_reduce of a metric does not count."""
    for call in script.calls(scope):
        if depth < 2 and any(
            _grads_reduced_by_hand(script, fn, depth + 1) for fn in script.local_callees(call)
        ):
            return True
        if "all_reduce" not in script.callee(call) and not unparse(call.func).endswith("all_reduce"):
            continue
        if any("grad" in unparse(a) for a in call.args):
            return True
        if any(isinstance(a, ast.For) and "parameters" in unparse(a.iter) for a in script.ancestors(call)):
            return True
    return False


def _backward_targets(script: Script) -> Iterator[tuple[ast.Call, ast.expr]]:
    for call in script.method_calls("backward"):
        f = call.func
        if not call.args and isinstance(f, ast.Attribute):
            value = f.value
            if (
                isinstance(value, ast.Call)
                and isinstance(value.func, ast.Attribute)
                and value.func.attr == "scale"
            ):
                value = value.args[0] if value.args else value
            yield call, value
        elif script.session_call(call, "backward") and kwarg(call, "tokens") is not None:
            continue  # s.backward(loss_sum, tokens=n): ddpkit scales to the global token mean
        elif call.args and (
            script.session_call(call, "backward") or script.callee(call) == "torch.autograd.backward"
        ):
            yield call, call.args[0]


def summed_loss(script: Script) -> Found:
    if not script.multi_rank or not script.wraps:
        return
    criteria = _criteria(script)
    for backward, target in _backward_targets(script):
        if _grads_reduced_by_hand(script, script.scope(backward)):
            continue  # gradients combined by hand: the user chose the arithmetic
        value: ast.expr | None = target
        if isinstance(target, ast.Name | ast.Attribute):
            value = script.last_assignment(unparse(target), backward)
        site = None if value is None else _sum_site(script, value, criteria)
        if site is not None:
            yield (
                site,
                f"`{unparse(value)}` sums this rank's samples; DDP divides by the world size",
            )


def sampler_without_epoch(script: Script) -> Found:
    if not script.multi_rank or script.mentions("set_epoch"):
        return
    trains_here = any(True for _ in _backward_targets(script))
    for call in script.calls():
        if last(script.callee(call)) != "DistributedSampler" or not trains_here or not _epoch_loop(script):
            continue
        shuffle = kwarg(call, "shuffle")
        if shuffle is None or is_const(shuffle, True):
            yield call, "no `set_epoch(epoch)` in this script: every epoch repeats the first epoch's order"


def _epoch_loop(script: Script) -> bool:
    """The file loops over epochs (`for epoch in ...`, `range(args.epochs)`): one pass needs no set_epoch."""
    return any(
        isinstance(n, ast.For) and "epoch" in (unparse(n.target) + unparse(n.iter)).lower()
        for n in ast.walk(script.tree)
    )


RULES = (
    Rule(
        "DDP003",
        "summed-loss",
        "a summed loss that DDP averages",
        "DDP divides the summed gradients by the world size: the step is 1/N of the one-process step on "
        "the global batch, and changes when the number of ranks or the per-rank batch does.",
        "use a mean (reduction='mean', .mean()), or divide the sum by the global sample/token count",
        summed_loss,
    ),
    Rule(
        "DDP005",
        "sampler-without-set-epoch",
        "a shuffling DistributedSampler without set_epoch",
        "The sampler shuffles with seed + epoch, and the epoch stays 0 unless set_epoch is called: every "
        "epoch repeats the first one's order. ddpkit's s.loader calls it and is not reported.",
        "call sampler.set_epoch(epoch) at the start of every epoch, or use s.loader(...)",
        sampler_without_epoch,
    ),
)
