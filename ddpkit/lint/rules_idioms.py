"""Rules about idioms a working DDP script brings along when it is ported to ddpkit: DDP015 (a
ddpkit collective under a rank test) and DDP016 (a loss divided by the accumulation count by hand).

Both apply only to calls on a ddpkit session (`s.save`, `s.backward`): they are right in the torch
script they come from (`torch.save` under `if master_process:`, `loss / gradient_accumulation_steps`
before `loss.backward()`) and wrong once ddpkit's call takes the place of torch's.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from ddpkit.lint.rule import Rule
from ddpkit.lint.script import FUNCTIONS, Script, is_const, kwarg, unparse

Found = Iterator[tuple[ast.AST, str]]

# The session's public methods that every rank must call at the same point (each runs a collective, or
# waits for the other ranks through the store): tests/test_lint_idioms.py checks this against `Session`.
COLLECTIVES = (
    "save",
    "load",
    "export",
    "barrier",
    "all_reduce",
    "any_rank",
    "all_ranks",
    "gather",
    "gather_object",
    "model",
    "backward",
    "step",
    "accumulate",
    "join",
)
_ACCUMULATION_NAME = re.compile(r"accum", re.IGNORECASE)
_RANK_NAME = re.compile(r"rank|gpu_id|device_id", re.IGNORECASE)
_MAIN_FLAG = re.compile(
    r"is_main|main_process|master|is_primary|leader|chief|rank_zero|is_rank0", re.IGNORECASE
)
Guard = ast.If | ast.IfExp | ast.BoolOp


# -- DDP015: a collective under a rank test -------------------------------------------------------------
def _partitions(test: ast.expr) -> bool:
    """A test that is true on some ranks only: a comparison of a rank (`rank == 0`, `dist.get_rank() == 0`,
    `int(os.environ["RANK"]) == 0`, `self.gpu_id == 0`), or a flag that names the main rank (`s.is_main`,
    `master_process`, `is_main_process()`). Not a "distributed or not" check (`local_rank == -1`, `rank
    is None`: the same answer on every rank), nor any other name with "rank" in it (`args.rank_file`)."""
    for sub in ast.walk(test):
        if isinstance(sub, ast.Compare) and any(_is_rank(side) for side in (sub.left, *sub.comparators)):
            return not any(
                (isinstance(c, ast.Constant) and c.value is None)
                or (isinstance(c, ast.UnaryOp) and isinstance(c.op, ast.USub) and is_const(c.operand, 1))
                for c in sub.comparators
            )
        flag = sub.func if isinstance(sub, ast.Call) else sub
        name = flag.id if isinstance(flag, ast.Name) else flag.attr if isinstance(flag, ast.Attribute) else ""
        if _MAIN_FLAG.search(name):
            return True
    return False


def _same_call_in(script: Script, branch: list[ast.stmt] | ast.expr, method: str) -> bool:
    nodes = branch if isinstance(branch, list) else [branch]
    return any(script.session_call(c, method) for n in nodes for c in script.calls(n))


def _is_rank(node: ast.expr) -> bool:
    """The expression is a rank (`rank`, `s.rank`, `self.gpu_id`, `dist.get_rank()`, `os.environ["RANK"]`,
    `rank % 2`), not something indexed by one (`stop_after[s.rank]`: each rank its own threshold)."""
    if isinstance(node, ast.Subscript):
        key = node.slice
        return isinstance(key, ast.Constant) and isinstance(key.value, str) and "RANK" in key.value.upper()
    if isinstance(node, ast.Call):
        return bool(_RANK_NAME.search(unparse(node.func))) or any(_is_rank(a) for a in node.args)
    if isinstance(node, ast.BinOp):
        return _is_rank(node.left) or _is_rank(node.right)
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return bool(_RANK_NAME.search(name))


def _leaves(body: list[ast.stmt]) -> bool:
    """The block ends by leaving the function or the loop (not by raising: that rank fails the job)."""
    return bool(body) and isinstance(body[-1], ast.Return | ast.Continue | ast.Break)


def _guard_here(script: Script, call: ast.Call, method: str) -> Guard | None:
    """The rank test in `call`'s own function that keeps it from some ranks: an enclosing `if` (or
    conditional expression, or `and`), or an earlier `if <rank test>: return` in an enclosing block.
    An `if` whose other branch makes the same call is no guard: every rank reaches one of the two."""
    child: ast.AST = call
    for a in script.ancestors(call):
        if isinstance(a, ast.If | ast.IfExp) and child is not a.test and _partitions(a.test):
            other = a.orelse if child in (a.body if isinstance(a, ast.If) else [a.body]) else a.body
            if not _same_call_in(script, other, method):
                return a
        if (
            isinstance(a, ast.BoolOp)
            and isinstance(a.op, ast.And)
            and child in a.values
            and any(_partitions(v) for v in a.values[: a.values.index(child)])
        ):
            return a
        for name in ("body", "orelse", "finalbody"):
            block = getattr(a, name, None)
            if isinstance(block, list) and child in block:
                for stmt in block[: block.index(child)]:
                    if isinstance(stmt, ast.If) and _partitions(stmt.test) and _leaves(stmt.body):
                        return stmt
        if isinstance(a, (*FUNCTIONS, ast.Lambda)):
            return None
        child = a
    return None


def _guard(
    script: Script, call: ast.Call, method: str, seen: frozenset = frozenset()
) -> tuple[Guard, str] | None:
    """The rank test that keeps `call` from some ranks, and the file's own function it is reached
    through ('' when the test is in the call's own function); None when every rank may reach it, or
    when that is not known here (a function never called in this file, or passed along)."""
    here = _guard_here(script, call, method)
    if here is not None:
        return here, ""
    fn = script.scope(call)
    if not isinstance(fn, FUNCTIONS) or fn in seen:
        return None
    refs = script.references(fn)
    calls = [script.parents.get(r) for r in refs]
    if not refs or not all(isinstance(c, ast.Call) and c.func is r for c, r in zip(calls, refs, strict=True)):
        return None
    found = [_guard(script, c, method, seen | {fn}) for c in calls]  # type: ignore[arg-type]
    if any(f is None for f in found):
        return None
    guard, _ = found[0]  # type: ignore[misc]
    return guard, fn.name


def _test_of(guard: Guard) -> str:
    if isinstance(guard, ast.BoolOp):
        return unparse(guard.values[0])
    return unparse(guard.test)


def collective_under_rank_test(script: Script) -> Found:
    if not script.session_names:
        return
    for call in script.calls():
        method = next((m for m in COLLECTIVES if script.session_call(call, m)), None)
        if method is None:
            continue
        found = _guard(script, call, method)
        if found is None:
            continue
        guard, via = found
        where = f"`{_test_of(guard)}` (line {guard.lineno})"
        reached = f"in {via}(), which is called only under {where}" if via else f"only under {where}"
        yield call, f"`{unparse(call.func)}(...)` runs {reached}: the other ranks never reach it"


# -- DDP016: the loss divided by the accumulation count before s.backward ----------------------------------
def _accumulations(script: Script) -> dict[str, ast.expr]:
    """Each session name of the file and the `accumulation=` it was opened with (1 and unset: none)."""
    out: dict[str, ast.expr] = {}
    for node in ast.walk(script.tree):
        pairs: list[tuple[ast.expr | None, ast.expr]] = []
        if isinstance(node, ast.With | ast.AsyncWith):
            pairs = [(i.optional_vars, i.context_expr) for i in node.items]
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            pairs = [(node.targets[0], node.value)]
        for target, expr in pairs:
            ctor = _session_ctor(script, expr)
            if not isinstance(target, ast.Name) or ctor is None:
                continue
            value = kwarg(ctor, "accumulation")
            if value is not None and not is_const(value, 1):
                out[target.id] = value
    return out


def _is_count(script: Script, node: ast.AST, session: str, count: ast.expr) -> bool:
    """Is `node` the session's accumulation count: the expression given as `accumulation=` (as written,
    or what a name for it stands for: `ga = args.grad_accum`), or `s.accumulation`?"""
    if unparse(node) in (unparse(count), f"{session}.accumulation"):
        return True
    if isinstance(node, ast.Constant) and isinstance(count, ast.Constant):
        return node.value == count.value
    resolved = script.value_of(node)
    same = unparse(resolved) == unparse(script.value_of(count))
    return same and resolved is not node and not isinstance(resolved, ast.Constant)


def _session_ctor(script: Script, node: ast.AST) -> ast.Call | None:
    """The `ddpkit.session(...)` of `with ddpkit.session(...) as s` or `s = ddpkit.session(...).start()`."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "start":
        node = node.func.value
    names = ("ddpkit.session", "ddpkit.session.session")
    return node if isinstance(node, ast.Call) and script.callee(node) in names else None


def _accumulating(script: Script, backward: ast.Call, session: str, count: ast.expr) -> bool:
    """`backward` runs in an accumulation: inside `with s.accumulate(...)`, or in a loop over the
    micro-steps (`for micro_step in range(<the accumulation>)`)."""
    for a in script.ancestors(backward):
        if isinstance(a, ast.With | ast.AsyncWith) and any(
            isinstance(i.context_expr, ast.Call) and script.session_call(i.context_expr, "accumulate")
            for i in a.items
        ):
            return True
        if (
            isinstance(a, ast.For)
            and isinstance(a.iter, ast.Call)
            and unparse(a.iter.func) == "range"
            and len(a.iter.args) == 1
            and _is_count(script, a.iter.args[0], session, count)
        ):
            return True
    return False


def _division(script: Script, loss: ast.expr, backward: ast.Call) -> ast.AST | None:
    """Where `loss` is divided (`loss / k`, or `loss = loss / k`, `loss /= k` before), or None."""
    if isinstance(loss, ast.BinOp) and isinstance(loss.op, ast.Div):
        return loss
    if isinstance(loss, ast.Name):
        value = script.last_assignment(loss.id, backward)
        if isinstance(value, ast.BinOp) and isinstance(value.op, ast.Div):
            return value
    return None


def loss_divided_by_accumulation(script: Script) -> Found:
    counts = _accumulations(script)
    if not counts:
        return  # accumulation 1, or not known here: s.backward divides by nothing to speak of
    for session, count in counts.items():
        for call in script.calls():
            if not script.session_call(call, "backward") or not call.args or kwarg(call, "tokens"):
                continue
            div = _division(script, call.args[0], call)
            if div is None or not _accumulating(script, call, session, count):
                continue
            divisor = div.right  # type: ignore[attr-defined]
            named = isinstance(divisor, ast.Name | ast.Attribute) and _ACCUMULATION_NAME.search(
                unparse(divisor)
            )
            if _is_count(script, divisor, session, count) or (named and not isinstance(count, ast.Constant)):
                yield (
                    div,
                    f"`{unparse(div)}` before `{unparse(call)}`, which divides by accumulation="
                    f"{unparse(count)} again",
                )


RULES = (
    Rule(
        "DDP015",
        "collective-under-rank-test",
        "a ddpkit collective under a rank test",
        "Every rank must call s.save, s.load, s.export, s.all_reduce, s.barrier (and s.gather, "
        "s.any_rank, s.model, s.backward, s.step) at the same point: ranks that skip it wait in their "
        "next collective for one that never comes, or abort with gloo's 'collective mismatch' at "
        "another line (s.backward). s.save writes each file once by itself; s.print prints on rank 0.",
        "call it on every rank (s.save writes each file once, global rank 0 the shared ones); keep only "
        "printing under the rank test, or use s.print",
        collective_under_rank_test,
    ),
    Rule(
        "DDP016",
        "loss-divided-by-accumulation",
        "a loss divided by the accumulation count before s.backward",
        "s.backward(loss) divides the loss by the session's accumulation itself; divided by hand too, "
        "every gradient is k times too small (with SGD the learning rate is divided by k; with AdamW "
        "epsilon and weight decay weigh k times more) and the printed loss is k times too small.",
        "pass the micro-batch's loss as it is: s.backward(loss) divides by accumulation",
        loss_divided_by_accumulation,
    ),
)
