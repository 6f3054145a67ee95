"""What a rule is and what it finds: `Rule` (code, name, the trap in a line, the fix, its check) and
`Finding` (path, line, column, code, message, fix).

Kept apart from the registry (`rules.py`) so that the rule modules import these two classes and the
registry imports the rule modules, one way: no import cycle inside `ddpkit.lint`.
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
