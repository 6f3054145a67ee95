"""What the rules need to know about one parsed script: names, order, branches, and who runs what.

Everything here is static (Python's `ast`, nothing imported or run) and errs on the side of silence:
where the answer is unknown (a function never called in the file, a model built elsewhere), the
helpers say "guarded" / "not resolved", so that rules stay quiet rather than guess.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property

Scope = ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)

# Identifiers that make a condition (or a message) rank-dependent: `if rank == 0`, `if s.is_main`.
_RANKISH = re.compile(r"rank|is_main|main_process|master|leader|is_primary|chief|is_first", re.IGNORECASE)
_INDEXISH = re.compile(r"gpu|device|proc|node|local|global|worker", re.IGNORECASE)
WRAPPERS = ("DistributedDataParallel", "FullyShardedDataParallel", "fully_shard", "FSDP")
_SPAWNERS = ("multiprocessing.spawn", "mp.spawn", "start_processes", "ddpkit.spawn", "Process")
_MULTI_RANK_MARKS = (
    "DistributedDataParallel",
    "init_process_group",
    "DistributedSampler",
    "fully_shard",
    "FullyShardedDataParallel",
    "ddpkit.session",
)


def unparse(node: ast.AST | None) -> str:
    return "" if node is None else ast.unparse(node)


def last(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def kwarg(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def is_const(node: ast.AST | None, value: object) -> bool:
    return isinstance(node, ast.Constant) and node.value == value and type(node.value) is type(value)


def rankish(node: ast.AST) -> bool:
    """Does the expression mention a rank (a name, an attribute, get_rank(), os.environ["RANK"])?"""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and _RANKISH.search(sub.id):
            return True
        if isinstance(sub, ast.Attribute) and _RANKISH.search(sub.attr):
            return True
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str) and "rank" in sub.value.lower():
            return True
    return False


def rank_test(test: ast.expr) -> bool:
    """A condition that runs its branch on some ranks only: it mentions a rank, or compares a
    process index with 0 (`self.gpu_id == 0`, `device_id == 0`; not `iter_num == 0`)."""
    if rankish(test):
        return True
    for sub in ast.walk(test):
        if (
            isinstance(sub, ast.Compare)
            and _INDEXISH.search(unparse(sub.left))
            and any(isinstance(op, ast.Eq | ast.NotEq) for op in sub.ops)
            and any(is_const(c, 0) for c in sub.comparators)
        ):
            return True
    return False


@dataclass
class Script:
    """One parsed file and the cross-references the rules share."""

    path: str
    source: str
    tree: ast.Module
    parents: dict[ast.AST, ast.AST] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, source: str, path: str = "<string>") -> Script:
        tree = ast.parse(source, filename=path)
        script = cls(path=path, source=source, tree=tree)
        for parent in ast.walk(tree):
            for child in ast.iter_child_nodes(parent):
                script.parents[child] = parent
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    script.aliases[a.asname or a.name.split(".")[0]] = (
                        a.name if a.asname else a.name.split(".")[0]
                    )
            elif isinstance(node, ast.ImportFrom) and node.module:
                for a in node.names:
                    script.aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        return script

    # -- names ----------------------------------------------------------------------------------
    def qualname(self, node: ast.AST) -> str:
        """`nn.BatchNorm2d` -> `torch.nn.BatchNorm2d` through the file's imports; '' if not a name."""
        parts: list[str] = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name):
            return ""
        parts.append(self.aliases.get(node.id, node.id))
        return ".".join(reversed(parts))

    def callee(self, call: ast.Call) -> str:
        return self.qualname(call.func)

    def calls(self, root: ast.AST | None = None) -> Iterator[ast.Call]:
        for node in ast.walk(root or self.tree):
            if isinstance(node, ast.Call):
                yield node

    def method_calls(self, attr: str, root: ast.AST | None = None) -> Iterator[ast.Call]:
        for call in self.calls(root):
            if isinstance(call.func, ast.Attribute) and call.func.attr == attr:
                yield call

    def mentions(self, word: str) -> bool:
        return word in self.source

    # -- the kind of script ---------------------------------------------------------------------
    @cached_property
    def uses_ddpkit(self) -> bool:
        return any(v == "ddpkit" or v.startswith("ddpkit.") for v in self.aliases.values())

    @cached_property
    def multi_rank(self) -> bool:
        """Written to run on several ranks: DDP/FSDP, a process group, a DistributedSampler, ddpkit."""
        names = {self.callee(c) for c in self.calls()} | set(self.aliases.values())
        return any(mark in n for n in names for mark in _MULTI_RANK_MARKS)

    @cached_property
    def sets_up_ranks(self) -> bool:
        """The process group is set up in this very file (init_process_group, a ddpkit session or
        spawn), so what this file does not do before training is not done elsewhere either; and
        `print` is not replaced by a rank-0-only one (the `builtins.print` idiom of DeiT/DINO/DETR)."""
        setup = ("init_process_group", "ddpkit.session", "ddpkit.spawn")
        here = any(self.callee(c).endswith(setup) for c in self.calls()) or bool(self.session_names)
        return here and not self.mentions("builtins")

    @cached_property
    def session_names(self) -> set[str]:
        """Names bound to a ddpkit session: `with ddpkit.session() as s`, `s = ddpkit.session()`."""
        out: set[str] = set()
        if not self.uses_ddpkit:
            return out
        for node in ast.walk(self.tree):
            if isinstance(node, ast.With | ast.AsyncWith):
                for item in node.items:
                    if self._is_session_ctor(item.context_expr) and isinstance(item.optional_vars, ast.Name):
                        out.add(item.optional_vars.id)
            elif isinstance(node, ast.Assign) and self._is_session_ctor(node.value):
                out.update(t.id for t in node.targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.arg) and (
                node.arg in ("s", "session") or last(unparse(node.annotation)) == "Session"
            ):
                out.add(node.arg)
        return out

    def _is_session_ctor(self, node: ast.AST) -> bool:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "start":
            node = node.func.value
        return isinstance(node, ast.Call) and self.callee(node) in (
            "ddpkit.session",
            "ddpkit.session.session",
        )

    def session_call(self, call: ast.Call, method: str) -> bool:
        """`s.<method>(...)` on a ddpkit session."""
        f = call.func
        return (
            isinstance(f, ast.Attribute)
            and f.attr == method
            and isinstance(f.value, ast.Name)
            and f.value.id in self.session_names
        )

    def is_wrap(self, call: ast.Call) -> bool:
        """DDP(...), FSDP(...), fully_shard(...) or ddpkit's s.model(...)."""
        return self.session_call(call, "model") or last(self.callee(call)) in WRAPPERS

    @cached_property
    def wraps(self) -> list[ast.Call]:
        return [c for c in self.calls() if self.is_wrap(c)]

    @cached_property
    def spawner(self) -> bool:
        """Ranks are started from this file's own top level (mp.spawn): module code runs once."""
        top = [c for c in self.calls() if self.scope(c) is self.tree]
        return any(self.callee(c).endswith(_SPAWNERS) for c in top)

    # -- structure ------------------------------------------------------------------------------
    def ancestors(self, node: ast.AST) -> Iterator[ast.AST]:
        while node in self.parents:
            node = self.parents[node]
            yield node

    def scope(self, node: ast.AST) -> Scope:
        return next((a for a in self.ancestors(node) if isinstance(a, (*FUNCTIONS, ast.Lambda))), self.tree)

    def statement(self, node: ast.AST) -> ast.stmt:
        if isinstance(node, ast.stmt):
            return node
        return next(a for a in self.ancestors(node) if isinstance(a, ast.stmt))

    def _branches(self, node: ast.AST) -> dict[ast.AST, str]:
        """For each enclosing if/try: which of its branches holds `node`."""
        out: dict[ast.AST, str] = {}
        child = node
        for a in self.ancestors(node):
            if isinstance(a, ast.If | ast.Try):
                for name in ("body", "orelse", "handlers", "finalbody"):
                    if child in getattr(a, name, ()):
                        out[a] = name
            elif isinstance(a, ast.IfExp):
                out[a] = "body" if child is a.body else "orelse" if child is a.orelse else "test"
            child = a
        return out

    def exclusive(self, a: ast.AST, b: ast.AST) -> bool:
        """`a` and `b` sit in different branches of one if/else: never both run."""
        ba, bb = self._branches(a), self._branches(b)
        return any(ba[k] != bb[k] and "test" not in (ba[k], bb[k]) for k in ba.keys() & bb.keys())

    def after(self, later: ast.AST, earlier: ast.AST) -> bool:
        """`later` runs after `earlier` in the same function body (source order, not in another branch)."""
        return (
            self.scope(later) is self.scope(earlier)
            and (later.lineno, later.col_offset) > (earlier.lineno, earlier.col_offset)  # type: ignore[attr-defined]
            and not self.exclusive(later, earlier)
        )

    def last_assignment(self, name: str, before: ast.AST) -> ast.expr | None:
        """The value most recently assigned to `name` (a name or `self.x`) before `before`, same scope;
        `loss /= n` reads as `loss / n`."""
        best: ast.Assign | ast.AugAssign | None = None
        for node in ast.walk(self.scope(before)):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            if (
                isinstance(node, ast.Assign | ast.AugAssign)
                and any(unparse(t) == name for t in targets)
                and self.scope(node) is self.scope(before)
                and node.lineno < before.lineno  # type: ignore[attr-defined]
                and (best is None or node.lineno > best.lineno)
            ):
                best = node
        if isinstance(best, ast.AugAssign):
            return ast.copy_location(ast.BinOp(left=best.target, op=best.op, right=best.value), best)
        return best.value if best else None

    def value_of(self, node: ast.AST | None) -> ast.AST | None:
        """What a name stands for: its last assignment before `node` in the same function, else its
        assignment at module level (`DDP_OPTS = {...}` used in main); the node itself otherwise."""
        if not isinstance(node, ast.Name):
            return node
        value = self.last_assignment(node.id, node)
        if value is None:
            for stmt in self.tree.body:
                if isinstance(stmt, ast.Assign) and any(unparse(t) == node.id for t in stmt.targets):
                    value = stmt.value
        return node if value is None else value

    def _options(self, call: ast.Call) -> Iterator[tuple[str | None, ast.expr]]:
        """The call's keywords, with `**opts` opened where opts is a dict literal or dict(...) in the file."""
        for k in call.keywords:
            if k.arg is not None:
                yield k.arg, k.value
                continue
            opts = self.value_of(k.value)
            if isinstance(opts, ast.Dict) and None not in opts.keys:
                for key, value in zip(opts.keys, opts.values, strict=True):
                    text = key.value if isinstance(key, ast.Constant) else None
                    yield (text if isinstance(text, str) else "?"), value
            elif isinstance(opts, ast.Call) and unparse(opts.func) == "dict" and not opts.args:
                yield from self._options(opts)
            else:
                yield None, k.value  # not known here

    def keyword(self, call: ast.Call, name: str) -> ast.expr | None:
        """Keyword `name` of `call`, also when passed in `**opts` (see `_options`)."""
        return next((v for k, v in self._options(call) if k == name), None)

    def unknown_keywords(self, call: ast.Call) -> bool:
        """Some `**kwargs` of the call cannot be opened: any keyword may be in there."""
        return any(k is None for k, _ in self._options(call))

    # -- functions and classes ------------------------------------------------------------------
    @cached_property
    def functions(self) -> dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef]]:
        out: dict[str, list] = {}
        for node in ast.walk(self.tree):
            if isinstance(node, FUNCTIONS):
                out.setdefault(node.name, []).append(node)
        return out

    @cached_property
    def classes(self) -> dict[str, ast.ClassDef]:
        return {n.name: n for n in ast.walk(self.tree) if isinstance(n, ast.ClassDef)}

    def local_callees(self, call: ast.Call) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
        """File-local functions or methods a call may reach (by name; a class call reaches __init__)."""
        f = call.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
        if name in self.classes:
            return [m for m in self.classes[name].body if isinstance(m, FUNCTIONS) and m.name == "__init__"]
        return self.functions.get(name, [])

    def references(self, fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.AST]:
        """Where `fn` is called or passed along in this file (for __init__: where its class is called)."""
        if fn.name == "__init__":
            owner = self.parents.get(fn)
            if not isinstance(owner, ast.ClassDef):
                return []
            return [c for c in self.calls() if isinstance(c.func, ast.Name) and c.func.id == owner.name]
        method = isinstance(self.parents.get(fn), ast.ClassDef)
        kind = ast.Attribute if method else ast.Name  # a method is reached as self.f / obj.f
        return [
            n
            for n in ast.walk(self.tree)
            if isinstance(n, kind) and (n.attr if method else n.id) == fn.name and isinstance(n.ctx, ast.Load)  # type: ignore[union-attr]
        ]

    # -- who runs it: every rank, or a guarded few ----------------------------------------------
    def guarded_here(self, node: ast.AST) -> bool:
        """Inside `if <rank test>:` (either branch), or after `if <rank test>: return` in its function."""
        child = node
        for a in self.ancestors(node):
            if isinstance(a, ast.If | ast.While | ast.IfExp) and child is not a.test and rank_test(a.test):
                return True
            if (
                isinstance(a, ast.BoolOp)
                and isinstance(a.op, ast.And)
                and any(rank_test(v) for v in a.values[: a.values.index(child)])  # type: ignore[arg-type]
            ):
                return True
            body = self._block_of(a, child)
            if body is not None:
                for stmt in body[: body.index(child)]:  # type: ignore[arg-type]
                    if isinstance(stmt, ast.If) and rank_test(stmt.test) and exits(stmt.body):
                        return True
            if isinstance(a, (*FUNCTIONS, ast.Lambda)):
                return False
            child = a
        return False

    @staticmethod
    def _block_of(parent: ast.AST, child: ast.AST) -> list[ast.stmt] | None:
        for name in ("body", "orelse", "finalbody"):
            block = getattr(parent, name, None)
            if isinstance(block, list) and child in block:
                return block
        return None

    def guarded(self, node: ast.AST, _seen: frozenset = frozenset()) -> bool:
        """Runs on some ranks only (or we cannot tell): guarded here, or every way into its function is."""
        if self.guarded_here(node):
            return True
        fn = self.scope(node)
        if isinstance(fn, ast.Module):  # the tree itself: module-level code
            return self.spawner  # top-level code of an mp.spawn launcher runs once, in the parent
        if isinstance(fn, ast.Lambda) or fn in _seen:
            return True
        if any(rankish(d) for d in fn.decorator_list):  # @rank_zero_only
            return True
        refs = self.references(fn)
        if not refs:
            return True  # never called here: unknown, so no finding
        if fn.name in ("forward", "__call__"):
            return False
        return all(self._guarded_ref(r, _seen | {fn}) for r in refs)

    def _guarded_ref(self, ref: ast.AST, seen: frozenset) -> bool:
        call = self.parents.get(ref)
        if isinstance(ref, ast.Call) or (isinstance(call, ast.Call) and call.func is ref):
            return self.guarded(ref if isinstance(ref, ast.Call) else call, seen)  # type: ignore[arg-type]
        return self.guarded_here(ref)  # passed along (mp.spawn(fn), a callback): runs on every rank


def exits(body: list[ast.stmt]) -> bool:
    return bool(body) and isinstance(body[-1], ast.Return | ast.Raise | ast.Continue | ast.Break)
