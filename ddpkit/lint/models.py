"""Following a model through a script: which expression is the model, which class built it, which
optimizer took its parameters. Shared by the rule modules; unresolved means "say nothing"."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ddpkit.lint.script import Script, last, unparse

# Methods that return the same module (moved, cast or switched mode): look through them.
_SAME_MODULE = ("to", "cuda", "cpu", "float", "double", "half", "bfloat16", "train", "eval", "requires_grad_")
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
_LAYERS_WITHOUT_BRANCHES = (
    "Linear",
    "Conv1d",
    "Conv2d",
    "Conv3d",
    "ReLU",
    "GELU",
    "SiLU",
    "Tanh",
    "Sigmoid",
    "Dropout",
    "LayerNorm",
    "BatchNorm1d",
    "BatchNorm2d",
    "BatchNorm3d",
    "MaxPool2d",
    "AvgPool2d",
    "Flatten",
    "Embedding",
    "Sequential",
    "Identity",
    "Softmax",
    "LogSoftmax",
    "AdaptiveAvgPool2d",
    "GroupNorm",
    "EmbeddingBag",
    "Parameter",
)


def origin(script: Script, expr: ast.AST | None, depth: int = 0) -> ast.AST | None:
    """The expression that built the module `expr` names: through names, `.to(...)`-like calls and wraps."""
    if expr is None or depth > 8:
        return expr
    if isinstance(expr, ast.Call):
        f = expr.func
        if isinstance(f, ast.Attribute) and f.attr in _SAME_MODULE:
            return origin(script, f.value, depth + 1)
        if script.is_wrap(expr) and expr.args:
            return origin(script, expr.args[0], depth + 1)
        return expr
    if isinstance(expr, ast.Name | ast.Attribute):
        value = script.last_assignment(unparse(expr), expr)
        return expr if value is None else origin(script, value, depth + 1)
    return expr


def model_class(script: Script, expr: ast.AST | None) -> ast.ClassDef | None:
    """The file-local class whose call built the module, if any."""
    built = origin(script, expr)
    if isinstance(built, ast.Call) and isinstance(built.func, ast.Name):
        return script.classes.get(built.func.id)
    return None


def contains_layer(
    script: Script, node: ast.AST, names: tuple[str, ...], _seen: frozenset = frozenset()
) -> bool:
    """Does building `node` (an expression or a class) create one of the torch layers `names`,
    directly or through the file's own module classes and functions (`conv_block(3, 64)`)?"""
    for call in script.calls(node):
        if last(script.callee(call)) in names:
            return True
        name = call.func.id if isinstance(call.func, ast.Name) else ""
        if name in _seen:
            continue
        if name in script.classes and contains_layer(script, script.classes[name], names, _seen | {name}):
            return True
        if any(contains_layer(script, fn, names, _seen | {name}) for fn in script.functions.get(name, [])):
            return True
    return False


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


def branch_free(script: Script, cls: ast.ClassDef, _seen: frozenset = frozenset()) -> bool:
    """Can every parameter of `cls` receive a gradient on every step? Only when forward has no branch,
    loop or early exit, returns one value, uses every submodule set in __init__, and those are plain
    torch layers or classes that pass the same test. Anything else counts as 'may need it'."""
    methods = {m.name: m for m in cls.body if isinstance(m, ast.FunctionDef)}
    forward, init = methods.get("forward"), methods.get("__init__")
    if forward is None or init is None or forward.args.vararg or forward.args.kwarg:
        return False
    control = (ast.If, ast.IfExp, ast.For, ast.While, ast.Try, ast.Match, ast.With, ast.comprehension)
    if any(isinstance(n, control) for n in ast.walk(forward)):
        return False
    returns = [n for n in ast.walk(forward) if isinstance(n, ast.Return)]
    if (
        len(returns) != 1
        or isinstance(returns[0].value, ast.Tuple | ast.List | ast.Dict)
        or forward.body[-1] is not returns[0]
    ):
        return False
    used = {n.attr for n in ast.walk(forward) if isinstance(n, ast.Attribute) and unparse(n.value) == "self"}
    if used & (methods.keys() - {"forward"}):
        return False  # forward calls a helper method: not followed, so assume it may branch
    for node in ast.walk(init):
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
            continue
        for target in node.targets:
            if not (isinstance(target, ast.Attribute) and unparse(target.value) == "self"):
                continue
            if target.attr not in used:
                return False  # a submodule forward never touches: its parameters get no gradient
            for call in script.calls(node.value):
                name = last(script.callee(call))
                local = script.classes.get(name)
                if local is not None:
                    if name in _seen or not branch_free(script, local, _seen | {cls.name}):
                        return False
                elif name not in _LAYERS_WITHOUT_BRANCHES and name[:1].isupper():
                    return False
    return True


def static_module(script: Script, expr: ast.AST | None) -> bool:
    """Is the module `expr` names certainly free of unused parameters (see `branch_free`)?"""
    built = origin(script, expr)
    if not isinstance(built, ast.Call):
        return False
    if isinstance(built.func, ast.Name) and built.func.id in script.classes:
        return branch_free(script, script.classes[built.func.id])
    name = script.callee(built)
    if not name.startswith("torch.nn.") or last(name) not in _LAYERS_WITHOUT_BRANCHES:
        return False
    inner = [a for a in built.args if isinstance(a, ast.Call)]
    return last(name) != "Sequential" or (
        len(inner) == len(built.args) and all(static_module(script, a) for a in inner)
    )
