"""The rule registry: every `Rule`, in code order.

A rule's `check` takes a parsed `Script` and yields `(node, detail)` pairs; the runner turns them into
`Finding`s (path, line, column, code, message, fix). Rules live in small modules grouped by topic
(`rules_model`, `rules_ranks`, `rules_loop`, `rules_data`, `rules_idioms`) and are collected here. The
imports run one way: the rule modules import `Rule` from `rule.py`, this registry imports the rule modules.
"""

from __future__ import annotations

from ddpkit.lint.rule import Check, Finding, Rule
from ddpkit.lint.rules_data import RULES as DATA_RULES
from ddpkit.lint.rules_idioms import RULES as IDIOM_RULES
from ddpkit.lint.rules_loop import RULES as LOOP_RULES
from ddpkit.lint.rules_model import RULES as MODEL_RULES
from ddpkit.lint.rules_ranks import RULES as RANK_RULES

__all__ = ["Check", "Finding", "Rule", "all_rules"]


def all_rules() -> tuple[Rule, ...]:
    """Every rule, in code order."""
    return tuple(
        sorted((*MODEL_RULES, *RANK_RULES, *LOOP_RULES, *DATA_RULES, *IDIOM_RULES), key=lambda r: r.code)
    )
