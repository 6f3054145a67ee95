"""Run the rules over files: read, parse, check, drop silenced lines, sort, render.

A line is silenced by `# ddpkit: noqa` (every rule), `# ddpkit: noqa: DDP003` or `# noqa: DDP003`
(the codes named; a bare `# noqa` belongs to other linters and silences nothing here). For a finding
on a statement that spans several lines, the comment may sit on any of them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ddpkit.lint.rules import Finding, Rule, all_rules
from ddpkit.lint.script import Script

_NOQA = re.compile(r"#\s*(ddpkit:\s*)?noqa(?::\s*(?P<codes>[A-Z]+[0-9]+(?:\s*,\s*[A-Z]+[0-9]+)*))?", re.I)


@dataclass(frozen=True)
class Unreadable:
    path: str
    reason: str

    def render(self) -> str:
        return f"{self.path}: error: {self.reason}"


def select_rules(select: Sequence[str] = (), ignore: Sequence[str] = ()) -> tuple[Rule, ...]:
    """The rules whose code starts with one of `select` (all when empty) and none of `ignore`."""
    rules = all_rules()
    known = {r.code for r in rules}
    for code in (*select, *ignore):
        if not any(k.startswith(code) for k in known):
            raise ValueError(f"unknown rule code {code!r}; the codes are {', '.join(sorted(known))}")
    return tuple(
        r
        for r in rules
        if (not select or r.code.startswith(tuple(select)))
        and not r.code.startswith(tuple(ignore) or ("\0",))
    )


def _silenced(lines: list[str], first: int, last: int, code: str) -> bool:
    for text in lines[first - 1 : last]:
        for m in _NOQA.finditer(text):
            codes = m.group("codes")
            if codes is None and m.group(1):  # `# ddpkit: noqa`
                return True
            if codes and code in {c.strip().upper() for c in codes.split(",")}:
                return True
    return False


def lint_source(source: str, path: str = "<string>", rules: Iterable[Rule] | None = None) -> list[Finding]:
    """The findings on one script's text (raises SyntaxError if it does not parse)."""
    script = Script.parse(source, path)
    lines = source.splitlines()
    found: dict[tuple[int, int, str], Finding] = {}
    for rule in all_rules() if rules is None else rules:
        for node, detail in rule.check(script):
            line, col = node.lineno, node.col_offset + 1  # type: ignore[attr-defined]
            end = getattr(node, "end_lineno", None) or line
            if _silenced(lines, line, end, rule.code):
                continue
            message = f"{rule.title}: {detail}" if detail else rule.title
            if rule.confidence != "high":
                message += f" [{rule.confidence} confidence]"
            found.setdefault((line, col, rule.code), Finding(path, line, col, rule.code, message, rule.fix))
    return [found[k] for k in sorted(found)]


def python_files(paths: Iterable[str]) -> list[Path]:
    out: list[Path] = []
    for p in map(Path, paths):
        out.extend(sorted(p.rglob("*.py")) if p.is_dir() else [p])
    return out


def lint_paths(
    paths: Iterable[str], rules: Iterable[Rule] | None = None
) -> tuple[list[Finding], list[Unreadable]]:
    """Findings over files and folders (folders: every *.py below), and the inputs that could not be read."""
    rules = tuple(all_rules() if rules is None else rules)
    findings: list[Finding] = []
    unreadable: list[Unreadable] = []
    for file in python_files(paths):
        try:
            source = file.read_text(encoding="utf-8")
            findings.extend(lint_source(source, str(file), rules))
        except (OSError, UnicodeDecodeError) as err:
            unreadable.append(Unreadable(str(file), f"cannot read it ({err.__class__.__name__}: {err})"))
        except SyntaxError as err:
            unreadable.append(Unreadable(str(file), f"not valid Python, line {err.lineno}: {err.msg}"))
    return findings, unreadable
