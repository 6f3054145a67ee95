"""`ddpkit lint` on every line ddpkit recommends: no finding, except the traps a page shows on purpose.

Read from whatever the files hold when the test runs (other branches add README sections): every
fenced Python block (```python, or an unlabelled fence that parses as Python) and every inline code
span that parses as Python and calls something, in README.md and docs/*.md; every examples/*.py; the
code cells of examples/notebooks/*.ipynb, joined as the notebook runs them.

A fragment says nothing about its surroundings (`s.backward(...)` alone is no multi-rank script), so
each is linted three times: as written, after a ddpkit preamble (a session and `s.model`), and after a
plain torch.distributed preamble (a process group and `DDP(...)`); a finding on the fragment's own
lines in any of the three counts.

A trap shown on purpose is marked where it stands, and the test checks that the marked trap IS found:
- in code (fenced blocks, examples): `# ddpkit: noqa: DDP003` on the line (the runner silences it; the
  test lints the line again without the comment and expects exactly that code there);
- in prose: `<!-- lint: DDP011 -->` right after the inline span (an HTML comment, invisible on the page).
"""

from __future__ import annotations

import ast
import json
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from ddpkit.lint import lint_source

ROOT = Path(__file__).resolve().parents[1]
DDPKIT_PREAMBLE = """import os, torch, torch.nn as nn, torch.nn.functional as F, torch.distributed as dist
import ddpkit
s = ddpkit.session(seed=0)
model = s.model(Net())
"""
TORCH_PREAMBLE = """import os, torch, torch.nn as nn, torch.nn.functional as F, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
rank = dist.get_rank()
model = DDP(Net())
"""
_FENCE = re.compile(r"^```(\w*)[ \t]*\n(.*?)^```", re.S | re.M)
_SPAN = re.compile(
    r"(?<!`)`([^`\n]+(?:\n[^`\n]+)*?)`(?!`)(?P<mark>\s*<!--\s*lint:\s*(?P<codes>[A-Z0-9, ]+?)\s*-->)?"
)
_CODE_MARK = re.compile(r"\s*#\s*ddpkit:\s*noqa:\s*(?P<codes>DDP\d+(?:\s*,\s*DDP\d+)*)[^\n]*")


@dataclass(frozen=True)
class Snippet:
    where: str  # file:line
    code: str
    fragment: bool  # lint in the two preambles too
    marked: tuple[str, ...] = ()  # prose marker: the codes this span shows on purpose


def _tree(code: str) -> ast.Module | None:
    try:
        return ast.parse(code)
    except SyntaxError:
        return None


def _calls(tree: ast.AST | None) -> bool:
    return tree is not None and any(isinstance(n, ast.Call) for n in ast.walk(tree))


def markdown_snippets(path: Path) -> list[Snippet]:
    return snippets_in_markdown(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))


def snippets_in_markdown(text: str, rel: str) -> list[Snippet]:
    out: list[Snippet] = []
    fences = list(_FENCE.finditer(text))
    for m in fences:
        body = textwrap.dedent(m.group(2))
        if m.group(1) in ("python", "py", "") and _calls(_tree(body)):
            out.append(Snippet(f"{rel}:{text.count(chr(10), 0, m.start()) + 2}", body, True))
    prose = text
    for m in reversed(fences):  # blank the fences, keep the line numbers
        prose = prose[: m.start()] + "\n" * m.group(0).count("\n") + prose[m.end() :]
    for m in _SPAN.finditer(prose):
        code = " ".join(m.group(1).split())
        if _calls(_tree(code)):
            codes = tuple(c.strip() for c in (m.group("codes") or "").split(",") if c.strip())
            out.append(Snippet(f"{rel}:{prose.count(chr(10), 0, m.start()) + 1}", code, True, codes))
    return out


def file_snippets(path: Path) -> list[Snippet]:
    rel = path.relative_to(ROOT)
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        lines = [
            line
            for c in cells
            if c["cell_type"] == "code"
            for line in "".join(c["source"]).splitlines()
            if not line.lstrip().startswith(("%", "!"))  # IPython magics and shell lines
        ]
        return [Snippet(str(rel), "\n".join(lines) + "\n", False)]
    return [Snippet(str(rel), path.read_text(encoding="utf-8"), False)]


def findings(snippet: Snippet, code: str | None = None) -> set[tuple[str, int]]:
    """(code, line within the snippet) over the snippet alone and, for fragments, in both preambles."""
    code = snippet.code if code is None else code
    out: set[tuple[str, int]] = set()
    for preamble in ("", DDPKIT_PREAMBLE, TORCH_PREAMBLE) if snippet.fragment else ("",):
        offset = preamble.count("\n")
        for f in lint_source(preamble + code, snippet.where):
            if f.line > offset:
                out.add((f.code, f.line - offset))
    return out


def check(snippet: Snippet) -> list[str]:
    """What is wrong with one snippet: a finding nobody marked, or a marked trap that is not found."""
    problems = []
    got = findings(snippet)
    if snippet.marked:
        if {c for c, _ in got} != set(snippet.marked):
            problems.append(
                f"{snippet.where}: `{snippet.code}` is marked {snippet.marked}, lint gives {sorted(got)}"
            )
        return problems
    problems += [
        f"{snippet.where}: `{snippet.code[:80]}...` gives {code} on its line {line}"
        for code, line in sorted(got)
    ]
    lines = snippet.code.splitlines()
    for i, line in enumerate(lines, start=1):
        m = _CODE_MARK.search(line)
        if m is None:
            continue
        wanted = {c.strip() for c in m.group("codes").split(",")}
        unmarked = "\n".join([*lines[: i - 1], line[: m.start()], *lines[i:]]) + "\n"
        at_line = {c for c, n in findings(snippet, unmarked) - got if n == i}
        if at_line != wanted:
            problems.append(
                f"{snippet.where}: line {i} is marked {sorted(wanted)}; without the mark: {sorted(at_line)}"
            )
    return problems


SOURCES = sorted(
    [
        ROOT / "README.md",
        *(ROOT / "docs").rglob("*.md"),  # the site's pages, guides included
        *(ROOT / "examples").glob("*.py"),
        *(ROOT / "examples").glob("notebooks/*.ipynb"),
    ]
)


def snippets_of(path: Path) -> list[Snippet]:
    return markdown_snippets(path) if path.suffix == ".md" else file_snippets(path)


@pytest.mark.parametrize("path", SOURCES, ids=[str(p.relative_to(ROOT)) for p in SOURCES])
def test_no_finding_on_what_the_docs_recommend(path: Path) -> None:
    problems = [p for s in snippets_of(path) for p in check(s)]
    assert problems == [], "\n".join(problems)


def test_the_snippets_are_really_read() -> None:
    """Guards the extraction itself: the README's blocks and spans (with the feature tour it links to),
    and the marks, are all seen."""
    readme = markdown_snippets(ROOT / "README.md") + markdown_snippets(ROOT / "docs" / "features.md")
    assert sum("\n" in s.code for s in readme) >= 5  # fenced blocks
    assert sum("\n" not in s.code for s in readme) >= 30  # inline examples
    assert any("s.model(" in s.code for s in readme)
    marked = [s for p in SOURCES for s in snippets_of(p) if s.marked or _CODE_MARK.search(s.code)]
    assert len(marked) >= 4  # docs/lint.md's shown traps, examples/manual_allreduce.py's summed loss


def test_a_marked_trap_that_is_not_found_fails_and_an_unmarked_one_is_reported() -> None:
    span = Snippet("t.md:1", "torch.nn.DataParallel(model)", True, ("DDP003",))
    assert check(span) and check(Snippet("t.md:1", span.code, True)) != []
    assert check(Snippet("t.md:1", span.code, True, ("DDP011",))) == []
    summed = 'loss = F.cross_entropy(model(x), y, reduction="sum")\nloss.backward()\n'
    assert check(Snippet("t.md:1", summed, True))  # reported: unmarked
    marked = summed.replace('"sum")', '"sum")  # ddpkit: noqa: DDP003 (shown on purpose)')
    assert check(Snippet("t.md:1", marked, True)) == []
    assert check(Snippet("t.md:1", marked.replace("DDP003", "DDP006"), True))  # wrong code: fails
    mention = snippets_in_markdown(
        "see `s.model(net)` and `torch.nn.DataParallel(m)` <!-- lint: DDP011 -->", "t.md"
    )
    assert [(s.code, s.marked) for s in mention] == [
        ("s.model(net)", ()),
        ("torch.nn.DataParallel(m)", ("DDP011",)),
    ]
