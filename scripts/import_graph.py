"""The import graph of ddpkit, read from the source (AST, no import): every `import ddpkit...` and
`from ddpkit... import ...`, at module level or inside functions, between ddpkit's modules.

    python scripts/import_graph.py            # the layer table (markdown), lowest layer first
    python scripts/import_graph.py --mermaid  # the same graph as a mermaid flowchart

A module's layer is 0 when it imports no other ddpkit module, else one more than the highest layer it
imports, so every arrow points down. The wings (training, cluster, step, parallel, checkpoint, observe,
tools) are drawn module by module; the other subpackages (verify, bench, plan, lint, strategy, data) count
as one node each; `ddpkit` is the public namespace (`import ddpkit`, `from ddpkit import session`), so a
tool that reaches the facade through it ranks above the facade.
docs/architecture.md holds the table this prints; tests/test_architecture.py checks they agree.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "ddpkit"


TOOL_PACKAGES = ("verify", "bench", "plan", "lint")  # the tools with their own package
WHOLE = (*TOOL_PACKAGES, "strategy", "data")  # subpackages drawn as one node each
WINGS = ("training", "cluster", "step", "parallel", "checkpoint", "observe", "tools")  # module by module


def node(module: str) -> str | None:
    """`ddpkit.verify.run` -> "verify", `ddpkit.cluster.launch` -> "cluster.launch", `ddpkit` -> "ddpkit"
    (the public namespace, `import ddpkit`), a wing's own `__init__` -> None (it holds only its docstring)."""
    parts = module.split(".")
    if parts[0] != "ddpkit":
        return None
    if len(parts) == 1:
        return "ddpkit"
    if parts[1] in WINGS:
        return ".".join(parts[1:3]) if len(parts) > 2 else None
    return parts[1]


def wing(n: str) -> str:
    """The wing a node belongs to, as `ls ddpkit/` shows it."""
    if n in TOOL_PACKAGES or n.startswith("tools.") or n == "cli":
        return "tools"
    if "." in n:
        return n.split(".")[0]
    return {"ddpkit": "public API", "errors": "root", "names": "root"}.get(n, n)


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of ddpkit by dotted name."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports_of(name: str, path: Path) -> set[str]:
    """The ddpkit modules `name` imports (anywhere in the file, TYPE_CHECKING blocks included)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for stmt in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(stmt, ast.Import):
            out.update(a.name for a in stmt.names if a.name.startswith("ddpkit"))
        elif isinstance(stmt, ast.ImportFrom):
            base = stmt.module or ""
            if stmt.level:
                parts = package.split(".")
                base = ".".join([*parts[: len(parts) - stmt.level + 1], base]).strip(".")
            if base.startswith("ddpkit"):
                out.update(f"{base}.{a.name}" for a in stmt.names)  # a module, or a name in one
    return out


def resolve(target: str, mods: dict[str, Path]) -> str:
    """The module an imported name lives in: its longest dotted prefix that is a module
    (`ddpkit.cluster.launch.LaunchConfig` -> `ddpkit.cluster.launch`, `ddpkit.session` -> `ddpkit`)."""
    while target not in mods and "." in target:
        target = target.rsplit(".", 1)[0]
    return target


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    """node -> the nodes it imports (self-imports left out; `ddpkit` is the public namespace)."""
    mods = modules(root)
    known = {node(m) for m in mods} - {None}
    edges: dict[str, set[str]] = {n: set() for n in known if n}
    for name, path in mods.items():
        src = node(name)
        if src is None:
            continue
        for target in imports_of(name, path):
            dst = node(resolve(target, mods))
            if dst and dst != src and dst in known:
                edges[src].add(dst)
    return edges


def layers(edges: dict[str, set[str]]) -> dict[str, int]:
    """Longest path down from each node; raises on a cycle."""
    level: dict[str, int] = {}
    visiting: set[str] = set()

    def visit(n: str) -> int:
        if n in level:
            return level[n]
        if n in visiting:
            raise SystemExit(f"import cycle through {n}")
        visiting.add(n)
        level[n] = 1 + max((visit(d) for d in edges[n]), default=-1)
        visiting.discard(n)
        return level[n]

    for n in sorted(edges):
        visit(n)
    return level


def table(edges: dict[str, set[str]]) -> str:
    level = layers(edges)
    rows = ["| layer | wing | module | imports (ddpkit) |", "|---|---|---|---|"]
    for n in sorted(edges, key=lambda n: (level[n], n)):
        rows.append(f"| {level[n]} | {wing(n)} | `{n}` | {', '.join(sorted(edges[n])) or '—'} |")
    return "\n".join(rows)


def mermaid(edges: dict[str, set[str]]) -> str:
    lines = ["flowchart TD"]
    for w in sorted({wing(n) for n in edges}):
        lines.append(f'    subgraph {w.replace(" ", "_")}["{w}"]')
        lines += [f'        {n.replace(".", "_")}["{n}"]' for n in sorted(edges) if wing(n) == w]
        lines.append("    end")
    for n in sorted(edges):
        lines += [f"    {n.replace('.', '_')} --> {d.replace('.', '_')}" for d in sorted(edges[n])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mermaid", action="store_true")
    ns = p.parse_args(argv)
    edges = graph()
    print(mermaid(edges) if ns.mermaid else table(edges))
    return 0


if __name__ == "__main__":
    sys.exit(main())
