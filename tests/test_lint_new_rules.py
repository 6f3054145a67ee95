"""`ddpkit lint`, this round: the rules for iterable datasets (DDP013) and reentrant activation
checkpointing (DDP014), the lines ddpkit recommends that were reported (DDP003, DDP009), and the
package's own imports (no cycle inside ddpkit/lint/). Static: nothing is imported from the scripts.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_lint_package_imports_one_way() -> None:
    """The registry imports the rule modules and the rule modules import `Rule` from `rule.py`: no
    module of ddpkit/lint/ reaches itself through its imports (it did through rules.py before)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import import_graph
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    mods = import_graph.modules(ROOT / "ddpkit")
    edges = {
        name: import_graph.imports_of(name, path) & mods.keys()
        for name, path in mods.items()
        if name.startswith("ddpkit.lint")
    }

    def reach(start: str) -> set[str]:
        seen: set[str] = set()
        todo = [start]
        while todo:
            for nxt in edges.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    assert len(edges) >= 10
    assert [m for m in edges if m in reach(m)] == []


def dedent(text: str) -> str:
    return textwrap.dedent(text)
