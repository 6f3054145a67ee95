"""`ddpkit lint` on the held-back corpus (tests/lint_heldout/, written by someone who did not read the
rules), scored against its answer key (ANSWERS.md).

    .venv/bin/python tests/test_lint_heldout.py     # per-rule table, then every miss and false finding

A planted trap counts as found when a finding with its rule's code points at the key's line, or at
an "alt" line the key's description gives ("alt: line 30", "call site line 76, alt"). Every other
finding is false: a finding on a clean script, or one of a code the file has no trap for, or at
another line. Per rule: recall = traps found / traps planted, precision = true findings / findings.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent / "lint_heldout"
CODES = {
    "A": "DDP001",
    "B": "DDP002",
    "C": "DDP003",
    "D": "DDP004",
    "E": "DDP005",
    "F": "DDP006",
    "G": "DDP007",
    "H": "DDP008",
    "I": "DDP009",
    "J": "DDP010",
    "K": "DDP011",
    "L": "DDP012",
    "M": "DDP013",
    "N": "DDP014",
}


@dataclass(frozen=True)
class Trap:
    file: str
    code: str
    lines: frozenset[int]  # the key's line and its alternatives


def answer_key(path: Path = HERE / "ANSWERS.md") -> tuple[list[Trap], list[str]]:
    """(the planted traps, the clean files) from the key's first table."""
    traps, clean = [], []
    for row in re.finditer(r"^\| (s\d+_\w+\.py) \| (\w+) \| ([-\d]+) \| (.*) \|$", path.read_text(), re.M):
        file, letter, line, text = row.groups()
        if letter == "CLEAN":
            clean.append(file)
            continue
        alts = {
            int(n)
            for p in re.findall(r"\(([^()]*)\)", text)
            if "alt" in p
            for n in re.findall(r"line (\d+)", p)
        }
        traps.append(Trap(file, CODES[letter], frozenset({int(line), *alts})))
    return traps, clean


def score(findings: list[tuple[str, str, int]], traps: list[Trap]) -> dict[str, dict[str, int]]:
    """Per code: planted, found (traps hit), reported (findings), true (findings that hit a trap)."""
    table: dict[str, dict[str, int]] = {
        c: dict(planted=0, found=0, reported=0, true=0) for c in CODES.values()
    }
    for t in traps:
        table[t.code]["planted"] += 1
        table[t.code]["found"] += any(f == t.file and c == t.code and n in t.lines for f, c, n in findings)
    for f, c, n in findings:
        table[c]["reported"] += 1
        table[c]["true"] += any(f == t.file and c == t.code and n in t.lines for t in traps)
    return table


def lint_corpus() -> list[tuple[str, str, int]]:
    from ddpkit.lint import lint_paths

    found, unreadable = lint_paths([str(p) for p in sorted(HERE.glob("s*.py"))])
    assert not unreadable, unreadable
    return [(Path(f.path).name, f.code, f.line) for f in found]


def render(table: dict[str, dict[str, int]]) -> str:
    def ratio(a: int, b: int) -> str:
        return f"{a}/{b}" if b else "-"

    rows = [
        "| rule | planted | found (recall) | findings | true (precision) |",
        "|---|---|---|---|---|",
    ]
    for code, r in table.items():
        rows.append(
            f"| {code} | {r['planted']} | {ratio(r['found'], r['planted'])} | {r['reported']} | {ratio(r['true'], r['reported'])} |"
        )
    total = {k: sum(r[k] for r in table.values()) for k in ("planted", "found", "reported", "true")}
    rows.append(
        f"| all | {total['planted']} | {ratio(total['found'], total['planted'])} | {total['reported']} | {ratio(total['true'], total['reported'])} |"
    )
    return "\n".join(rows)


# The three planted traps the rules do not report, each on purpose (docs/lint.md, "Held-back corpus"):
# a rank-tagged print is a deliberate per-rank log (pytorch/examples' minGPT prints `[GPU{id}] ... Loss`);
# a model named at run time (`torchvision.models.__dict__[args.arch]`) is not followed; a per-rank seed
# before DDP(...) is harmless (DDP broadcasts rank 0's weights when it wraps; measured).
NOT_REPORTED = {
    ("s08_regression_torchrun.py", "DDP007"),
    ("s09_resnet_torchvision.py", "DDP002"),
    ("s11_seq2seq_seed.py", "DDP008"),
}


def _hit(trap: Trap, found: list[tuple[str, str, int]]) -> bool:
    return any(f == trap.file and c == trap.code and n in trap.lines for f, c, n in found)


def test_the_key_is_read_whole() -> None:
    traps, clean = answer_key()
    assert (len(traps), len(clean)) == (22, 8)
    assert {p.name for p in HERE.glob("s*.py")} == {t.file for t in traps} | set(clean)


def test_every_planted_trap_is_found_at_its_line() -> None:
    """After the fixes (no longer held-back): 19 of 22, the three others not reported on purpose."""
    traps, _ = answer_key()
    found = lint_corpus()
    missed = {(t.file, t.code) for t in traps if not _hit(t, found)}
    assert missed == NOT_REPORTED


def test_no_false_finding_on_the_corpus() -> None:
    """No finding on the 8 clean scripts, and none on a trapped script but its trap."""
    traps, clean = answer_key()
    found = lint_corpus()
    assert [f for f in found if f[0] in clean] == []
    assert [
        f for f in found if not any(f[0] == t.file and f[1] == t.code and f[2] in t.lines for t in traps)
    ] == []
    table = score(found, traps)
    assert sum(r["found"] for r in table.values()) == 19 and sum(r["reported"] for r in table.values()) == 19


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parents[1]))
    traps, clean = answer_key()
    found = lint_corpus()
    print(render(score(found, traps)))
    print("\nmissed:")
    for t in traps:
        if not any(f == t.file and c == t.code and n in t.lines for f, c, n in found):
            print(f"  {t.file} {t.code} line {sorted(t.lines)}")
    print("false findings:")
    for f, c, n in found:
        if not any(f == t.file and c == t.code and n in t.lines for t in traps):
            print(f"  {f}:{n} {c}")
