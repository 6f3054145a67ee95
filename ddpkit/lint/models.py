"""Following a model through a script: which expression is the model, which class built it, whether
its forward can leave a parameter without a gradient. Shared by the rule modules (which optimizer took
its parameters: `ddpkit.lint.optimizers`); unresolved means "say nothing"."""

from __future__ import annotations

import ast

from ddpkit.lint.script import Script, last, unparse

# Methods that return the same module (moved, cast or switched mode): look through them.
_SAME_MODULE = ("to", "cuda", "cpu", "float", "double", "half", "bfloat16", "train", "eval", "requires_grad_")
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
