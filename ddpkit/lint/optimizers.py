"""Following an optimizer through a script: which calls build torch optimizers, whose parameters
they take (also through a file-local helper and under a wrapped model's earlier name). Shared by the
rule modules with `ddpkit.lint.models`; unresolved means "say nothing"."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ddpkit.lint.script import Script, last, unparse

TORCH_OPTIMIZERS = (
    "SGD",
    "Adam",
    "AdamW",
    "Adamax",
    "Adagrad",
    "Adadelta",
    "RMSprop",
    "Rprop",
    "NAdam",
    "RAdam",
    "ASGD",
    "LBFGS",
    "SparseAdam",
    "Adafactor",
    "Muon",
)


def is_optimizer(script: Script, call: ast.Call) -> bool:
    name = script.callee(call)
    return name.startswith("torch.optim.") or last(name) in TORCH_OPTIMIZERS


def optimizer_params(script: Script) -> Iterator[tuple[ast.Call, str]]:
    """(optimizer constructor, text of the module whose .parameters() it took)."""
    for call in script.calls():
        if not is_optimizer(script, call):
            continue
        for arg in [*call.args, *(k.value for k in call.keywords)]:
            for sub in script.calls(arg):
                if isinstance(sub.func, ast.Attribute) and sub.func.attr in (
                    "parameters",
                    "named_parameters",
                ):
                    yield call, unparse(sub.func.value)


def binding(script: Script, call: ast.Call, fn: ast.FunctionDef | ast.AsyncFunctionDef) -> dict[str, str]:
    """A file-local function's parameter names -> the text of the arguments `call` passes."""
    params = [a.arg for a in fn.args.args]
    if isinstance(script.parents.get(fn), ast.ClassDef) and params[:1] in (["self"], ["cls"]):
        params = params[1:]
    out = {name: unparse(arg) for name, arg in zip(params, call.args, strict=False)}
    out.update({k.arg: unparse(k.value) for k in call.keywords if k.arg in params})
    return out


def translate(text: str, bound: dict[str, str]) -> str:
    """A helper's `model.layers` -> the caller's `net.layers`; `self.model` stays (same object in a
    method); '' for the helper's own local names."""
    head, dot, rest = text.partition(".")
    if head in bound:
        return bound[head] + dot + rest
    return text if head == "self" else ""


def helper_optimizers(script: Script) -> Iterator[tuple[ast.Call, str]]:
    """(call of a file-local helper that builds a torch optimizer, text of the caller's module whose
    parameters it takes): `optimizer = configure_optimizer(model, lr)`."""
    for call in script.calls():
        for fn in script.local_callees(call):
            if not any(is_optimizer(script, c) for c in script.calls(fn)):
                continue
            bound = binding(script, call, fn)
            for sub in script.calls(fn):
                if isinstance(sub.func, ast.Attribute) and sub.func.attr in (
                    "parameters",
                    "named_parameters",
                ):
                    text = translate(unparse(sub.func.value), bound)
                    if text:
                        yield call, text


def optimizers_by_model(script: Script) -> dict[str, ast.Call]:
    """Optimizer constructors by the text of the module they train, also under the name the module had
    before wrapping (`opt` over `ddp_model.parameters()`, `ddp_model = DDP(model)`: also `model`)."""
    out = {text: opt for opt, text in optimizer_params(script)}
    for wrap in script.wraps:
        stmt = script.parents.get(wrap)
        if isinstance(stmt, ast.Assign) and wrap.args:
            for t in stmt.targets:
                if unparse(t) in out:
                    out.setdefault(unparse(wrap.args[0]), out[unparse(t)])
    return out


def model_texts(script: Script) -> set[str]:
    """Texts that name a trained model: what optimizers take parameters of, and what gets wrapped."""
    out = {text for _, text in optimizer_params(script)}
    for wrap in script.wraps:
        if wrap.args:
            out.add(unparse(wrap.args[0]))
        stmt = script.parents.get(wrap)
        if isinstance(stmt, ast.Assign):
            out.update(unparse(t) for t in stmt.targets)
    return out
