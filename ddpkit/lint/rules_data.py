"""Rules about the data each rank reads: DDP013 (an IterableDataset that every rank reads whole).

A `DistributedSampler` splits a map-style dataset over the ranks; an `IterableDataset` has no sampler,
so it must split itself: its `__iter__` reads the rank and world size (and, with DataLoader workers,
`torch.utils.data.get_worker_info()`), or the stream is split before it reaches the loader
(`split_dataset_by_node`, a file list cut per rank, ddpkit's `s.loader`). Otherwise every rank and every
worker reads the whole stream: measured on 2 gloo ranks x 2 workers, each sample was read 4 times.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from ddpkit.lint.rule import Rule
from ddpkit.lint.script import FUNCTIONS, Script, last, rankish, unparse

Found = Iterator[tuple[ast.AST, str]]
# Names that split a stream: the rank, the world size, the worker info, a node or replica split.
_SPLITS = re.compile(r"rank|world|worker|replica|num_nodes|node_id|split_by_node|split_dataset_by_node", re.I)
_RANK_SPLITS = re.compile(r"rank|world|replica|num_nodes|node_id|by_node", re.I)  # not the workers


def _splitting(node: ast.AST, words: re.Pattern[str] = _SPLITS) -> bool:
    """Does the expression or body mention a rank, world size or worker (a name, attribute, string)?"""
    if rankish(node):
        return True
    for sub in ast.walk(node):
        word = (
            sub.id
            if isinstance(sub, ast.Name)
            else sub.attr
            if isinstance(sub, ast.Attribute)
            else sub.value
            if isinstance(sub, ast.Constant) and isinstance(sub.value, str)
            else ""
        )
        if words.search(word):
            return True
    return False


def _bases(script: Script, cls: ast.ClassDef, depth: int = 0) -> Iterator[ast.ClassDef | str]:
    """The class itself, its file-local ancestors, and the qualified names of the others."""
    yield cls
    for base in cls.bases:
        name = script.qualname(base)
        local = script.classes.get(name)
        if local is not None and local is not cls and depth < 8:
            yield from _bases(script, local, depth + 1)
        else:
            yield name


def iterable_datasets(script: Script) -> Iterator[ast.ClassDef]:
    for cls in script.classes.values():
        if any(isinstance(b, str) and last(b) == "IterableDataset" for b in _bases(script, cls)):
            yield cls


def _method(script: Script, cls: ast.ClassDef, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    for owner in _bases(script, cls):
        if isinstance(owner, ast.ClassDef):
            for m in owner.body:
                if isinstance(m, FUNCTIONS) and m.name == name:
                    return m
    return None


def _reads_split(script: Script, cls: ast.ClassDef, fn: ast.AST, seen: set) -> bool:
    """`fn` (or a method or file-level function it calls, followed) mentions the rank or the workers."""
    if fn in seen:
        return False
    seen.add(fn)
    if _splitting(fn):
        return True
    for call in script.calls(fn):
        f = call.func
        if isinstance(f, ast.Attribute) and unparse(f.value) == "self":
            helper = _method(script, cls, f.attr)
            helpers = [helper] if helper is not None else []
        else:
            helpers = script.functions.get(f.id, []) if isinstance(f, ast.Name) else []
        if any(_reads_split(script, cls, h, seen) for h in helpers):
            return True
    return False


def _split_outside(script: Script, cls: ast.ClassDef) -> bool:
    """An instance built with the rank (`Stream(files[rank::world])`), or handed to something that
    splits it: ddpkit's `s.loader`, a split/shard call, or a call that also gets the rank."""
    for call in script.calls():
        if not (isinstance(call.func, ast.Name) and call.func.id == cls.name):
            continue
        if any(_splitting(a, _RANK_SPLITS) for a in [*call.args, *(k.value for k in call.keywords)]):
            return True
        stmt = script.parents.get(call)
        names = {unparse(t) for t in stmt.targets} if isinstance(stmt, ast.Assign) else set()
        for use in script.calls():
            args = [*use.args, *(k.value for k in use.keywords)]
            if not any(a is call or unparse(a) in names for a in args):
                continue
            others = [a for a in args if a is not call and unparse(a) not in names]
            if (
                script.session_call(use, "loader")
                or re.search(r"split|shard", unparse(use.func), re.I)
                or any(_splitting(a, _RANK_SPLITS) for a in others)
            ):
                return True
    return False


def iterable_not_split(script: Script) -> Found:
    if not script.multi_rank:
        return
    for cls in iterable_datasets(script):
        it = _method(script, cls, "__iter__")
        if it is None or not any(isinstance(n, ast.Yield | ast.YieldFrom | ast.Return) for n in ast.walk(it)):
            continue  # abstract, or built elsewhere
        init = _method(script, cls, "__init__")
        if _reads_split(script, cls, it, set()) or (init is not None and _splitting(init)):
            continue
        if not _split_outside(script, cls):
            yield (
                it,
                f"`{cls.name}.__iter__` reads neither the rank nor get_worker_info(): every rank and every "
                "DataLoader worker yields the whole stream",
            )


RULES = (
    Rule(
        "DDP013",
        "iterable-not-split",
        "an IterableDataset that every rank reads whole",
        "An IterableDataset gets no DistributedSampler: unless its __iter__ splits the stream by the rank "
        "and world size (and by get_worker_info() with DataLoader workers), every rank and every worker "
        "yields every sample (measured: 2 ranks x 2 workers read each sample 4 times), so an epoch trains "
        "N x workers times on the same data.",
        "in __iter__, take every (world_size x num_workers)-th item from rank x num_workers + worker id "
        "(torch.utils.data.get_worker_info(), dist.get_rank()); or split before (split_dataset_by_node)",
        iterable_not_split,
    ),
)
