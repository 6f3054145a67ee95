"""`ddpkit lint`: find DDP traps in training scripts without running them.

    ddpkit lint train.py                     # path:line:col: CODE message (fix: ...)
    ddpkit lint src/ --ignore DDP007         # folders: every *.py below; --select/--ignore by code prefix
    ddpkit lint --list-rules                 # every rule: code, name, what goes wrong, the fix

Exit status: 0 when clean, 1 when something was found, 2 when an input cannot be read or parsed.
Silence one line with `# ddpkit: noqa` or `# noqa: DDP003`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ddpkit.lint.runner import lint_paths, select_rules


def _codes(value: str) -> list[str]:
    return [c.strip().upper() for c in value.split(",") if c.strip()]


def build_parser() -> argparse.ArgumentParser:
    """The command's options; tests/options/cli.toml names a test for each."""
    p = argparse.ArgumentParser(prog="ddpkit lint", description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="*", help="scripts or folders to check")
    p.add_argument("--select", type=_codes, default=[], help="only these codes (prefixes), comma-separated")
    p.add_argument("--ignore", type=_codes, default=[], help="skip these codes (prefixes), comma-separated")
    p.add_argument("--list-rules", action="store_true", help="describe every rule and exit")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    ns = p.parse_args(argv)
    try:
        rules = select_rules(ns.select, ns.ignore)
    except ValueError as err:
        p.error(str(err))
    if ns.list_rules:
        for r in rules:
            conf = "" if r.confidence == "high" else f" [{r.confidence} confidence]"
            print(f"{r.code} {r.name}{conf}: {r.title}\n    {r.problem}\n    fix: {r.fix}")
        return 0
    if not ns.paths:
        p.error("give at least one script or folder, e.g. `ddpkit lint train.py`")
    findings, unreadable = lint_paths(ns.paths, rules)
    for f in findings:
        print(f.render())
    for u in unreadable:
        print(u.render(), file=sys.stderr)
    if findings:
        n = len(findings)
        print(f"ddpkit lint: {n} finding{'s' * (n != 1)}", file=sys.stderr)
    return 2 if unreadable else 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
