"""The rule registry: one `Rule` per trap, each with its code, the problem in a line, and the fix.

A rule's `check` takes a parsed `Script` and yields `(node, detail)` pairs; the runner turns them into
`Finding`s (path, line, column, code, message, fix). Rules live in small modules grouped by topic
(`rules_model`, `rules_ranks`, `rules_loop`) and are collected here, in code order.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ddpkit.lint.script import Script

Check = Callable[[Script], Iterator[tuple[ast.AST, str]]]


@dataclass(frozen=True)
class Rule:
    code: str
    name: str
    title: str  # the trap in a few words, first in every finding
    problem: str  # what goes wrong, one or two sentences (docs and --list-rules)
    fix: str  # what to write instead, short
    check: Check
    confidence: str = "high"


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    col: int
    code: str
    message: str
    fix: str

    def render(self) -> str:
        return f"{self.path}:{self.line}:{self.col}: {self.code} {self.message} (fix: {self.fix})"


def all_rules() -> tuple[Rule, ...]:
    """Every rule, in code order (imported here so that the rule modules can import `Rule`)."""
    from ddpkit.lint import rules_loop, rules_model, rules_ranks

    return tuple(sorted((*rules_model.RULES, *rules_ranks.RULES, *rules_loop.RULES), key=lambda r: r.code))
