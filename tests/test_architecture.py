"""The architecture as checks: the import contracts (.importlinter: layer order, lower layers never
import the facade, tools use the public API), docs/architecture.md against the real import graph,
process-wide state listed in one place, and modules short enough to read in one sitting."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import fresh_python

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
# One concern per module, measured by what the code names (`independent_groups`), not by its length; a
# formatted module past the backstop usually holds two (../shared/STYLE.md), whatever the check finds.
CONCERN_LINES = 80  # two unrelated groups of definitions this long are two concerns
BACKSTOP_LINES = 600


def _lint_imports(pythonpath: Path) -> subprocess.CompletedProcess:
    cli = Path(sys.executable).with_name("lint-imports")
    assert cli.exists(), "import-linter is missing: pip install -e '.[test]'"
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    return subprocess.run(
        [str(cli), "--no-cache", "--config", str(ROOT / ".importlinter")],
        cwd=pythonpath,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )


def test_import_contracts_hold() -> None:
    run = _lint_imports(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Contracts: 5 kept, 0 broken." in run.stdout  # layers, data (inside), facade, tools, wings


def test_import_contracts_fail_when_broken(tmp_path: Path) -> None:
    """A copy of the package where a tool reaches past the public API and a lower layer imports the
    facade: the contracts must say so."""
    shutil.copytree(ROOT / "ddpkit", tmp_path / "ddpkit", ignore=shutil.ignore_patterns("__pycache__"))
    with open(tmp_path / "ddpkit" / "tools" / "trace.py", "a") as f:
        f.write("\nfrom ddpkit.step import sharding  # noqa\n")
    with open(tmp_path / "ddpkit" / "step" / "stepping.py", "a") as f:
        f.write("\nfrom ddpkit.training.session import Session  # noqa\n")
    with open(tmp_path / "ddpkit" / "checkpoint" / "write.py", "a") as f:
        f.write("\nfrom ddpkit.step import sharding  # noqa\n")  # checkpoint -> step -> ... -> checkpoint
    run = _lint_imports(tmp_path)
    assert run.returncode != 0
    assert "ddpkit.tools is not allowed to import ddpkit.step.sharding" in run.stdout
    assert "ddpkit.tools.trace -> ddpkit.step.sharding" in run.stdout
    assert "ddpkit.step is not allowed to import ddpkit.training" in run.stdout
    assert "ddpkit.step.stepping -> ddpkit.training.session" in run.stdout
    assert "No cycles are allowed in ddpkit." in run.stdout


def test_architecture_doc_matches_the_import_graph() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import import_graph
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    table = import_graph.table(import_graph.graph(ROOT / "ddpkit"))
    assert table in DOC.read_text(), "docs/architecture.md is stale: paste `python scripts/import_graph.py`"


def _process_wide(path: Path) -> set[str]:
    """In one module, as 'module:NAME': module-level containers (mutable by anyone), `global NAME`
    statements, and writes to os.environ."""
    found: set[str] = set()
    module = path.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".")
    tree = ast.parse(path.read_text())
    for n in tree.body:
        target = (
            n.targets[0] if isinstance(n, ast.Assign) else n.target if isinstance(n, ast.AnnAssign) else None
        )
        value = getattr(n, "value", None)
        mutable = isinstance(value, (ast.Dict, ast.List, ast.Set)) or (
            isinstance(value, ast.Call) and ast.unparse(value.func) in ("dict", "list", "set")
        )
        if (
            isinstance(target, ast.Name)
            and mutable
            and not target.id.isupper()
            and not target.id.startswith("__")
        ):
            found.add(f"{module}:{target.id}")
    for n in ast.walk(tree):
        if isinstance(n, ast.Global):
            found.update(f"{module}:{name}" for name in n.names)
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
            target = ast.unparse(n.func.value)
            if target == "os.environ" and n.func.attr in ("update", "setdefault", "pop", "clear"):
                found.add(f"{module}:os.environ")
        elif isinstance(n, (ast.Assign, ast.AugAssign)):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            if any(isinstance(t, ast.Subscript) and ast.unparse(t.value) == "os.environ" for t in targets):
                found.add(f"{module}:os.environ")
    return found


def test_process_wide_state_is_listed_in_one_place() -> None:
    """Every module-level variable a function rebinds, and every environment write, is in the table
    of docs/architecture.md ("Process-wide state"), which says why it outlives a session."""
    doc = DOC.read_text()
    section = doc[doc.index("## Process-wide state") :]
    found = set().union(*(_process_wide(p) for p in sorted((ROOT / "ddpkit").rglob("*.py"))))
    missing = sorted(f for f in found if f"`{f}`" not in section)
    assert not missing, f"process-wide state not listed in docs/architecture.md: {missing}"


def _definitions(tree: ast.Module) -> dict[str, ast.stmt]:
    """A module's top-level definitions by name: functions, classes and assigned names."""
    found: dict[str, ast.stmt] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found[node.name] = node
        elif isinstance(node, ast.Assign):
            found.update((t.id, node) for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            found[node.target.id] = node
    return found


def independent_groups(source: str, min_lines: int = CONCERN_LINES) -> list[tuple[int, list[str]]]:
    """The groups of a module's top-level definitions that name nothing of each other (two definitions
    join when one's body names the other), with their lines, largest first; only groups of `min_lines`
    or more. Two such groups in one module are two concerns that share no name: two modules."""
    definitions = _definitions(ast.parse(source))
    joined: dict[str, set[str]] = {name: set() for name in definitions}
    for name, node in definitions.items():
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name) and sub.id in definitions and sub.id != name:
                joined[name].add(sub.id)
                joined[sub.id].add(name)
    seen: set[str] = set()
    groups = []
    for start in definitions:
        if start in seen:
            continue
        todo, group = [start], []
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            group.append(name)
            todo.extend(joined[name] - seen)
        nodes = {id(definitions[n]): definitions[n] for n in group}.values()
        lines = sum(n.end_lineno - n.lineno + 1 for n in nodes)  # type: ignore[operator]
        if lines >= min_lines:
            groups.append((lines, sorted(group)))
    return sorted(groups, reverse=True)


@pytest.mark.parametrize("path", sorted((ROOT / "ddpkit").rglob("*.py")), ids=lambda p: p.name)
def test_a_module_holds_one_concern(path: Path) -> None:
    source = path.read_text()
    groups = independent_groups(source)
    named = "; ".join(f"{n} lines: {', '.join(g[:4])}" for n, g in groups)
    assert len(groups) < 2, (
        f"{path.relative_to(ROOT)} holds {len(groups)} groups of definitions that name nothing of each other "
        f"({named}): one concern per module, so "
        "move one group into a module of its own"
    )
    lines = len(source.splitlines())
    assert lines <= BACKSTOP_LINES, (
        f"{path.relative_to(ROOT)} has {lines} lines as formatted: split it by concern (one concern per module)"
    )


def test_two_unrelated_groups_are_two_concerns_and_a_call_joins_them() -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(CONCERN_LINES))
    two = f"def reads():\n{body}\n\ndef writes():\n{body}"
    assert [n for n, _ in independent_groups(two)] == [CONCERN_LINES + 1] * 2
    joined = two + "    reads()\n"
    assert len(independent_groups(joined)) == 1


def test_a_ddp_first_step_does_not_import_fsdp_or_checkpoint_files() -> None:
    """Every module a session imports is part of every rank's time to the first step (issue 20): FSDP2's
    strategy and safetensors are imported when FSDP or a checkpoint asks for them, not before."""
    code = (
        "import sys, torch, ddpkit\n"
        "with ddpkit.session(seed=0, verbose=False) as s:\n"
        "    model = s.model(lambda: torch.nn.Linear(4, 1))  # a factory, as FSDP users pass\n"
        "    opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "    s.backward(model(torch.ones(2, 4)).sum()); s.step(opt)\n"
        "    print(sorted(m for m in ('ddpkit.strategy.fsdp', 'ddpkit.checkpoint.files', 'safetensors')"
        " if m in sys.modules))\n"
        "    import ddpkit.strategy as st\n"
        "    print(st.FSDP.__module__, 'ddpkit.strategy.fsdp' in sys.modules)\n"
    )
    assert fresh_python(code).splitlines() == ["[]", "ddpkit.strategy.fsdp True"]


def test_every_module_is_in_a_layer() -> None:
    """Each module of ddpkit is in the layers contract (named, or inside a package named there), so no
    module can import upward unnoticed; a wing's `__init__` holds only its docstring."""
    config = (ROOT / ".importlinter").read_text()
    block = config[config.index("[importlinter:contract:layers]") :].split("\n\n")[0]
    listed = {
        m.strip() for line in block.split("layers =")[1].splitlines() for m in line.split("|") if m.strip()
    }
    modules = {
        p.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".").removesuffix(".__init__")
        for p in (ROOT / "ddpkit").rglob("*.py")
    }
    wings = {
        m for m in modules if m.count(".") == 1 and (ROOT / m.replace(".", "/") / "__init__.py").exists()
    }
    outside = sorted(
        m
        for m in modules - {"ddpkit"} - (wings - listed)
        if not any(m == layer or m.startswith(layer + ".") for layer in listed)
    )
    assert not outside, f"modules in no layer of .importlinter: {outside}"
    for wing in wings - listed:  # the wings drawn module by module: their __init__ imports nothing
        text = (ROOT / wing.replace(".", "/") / "__init__.py").read_text()
        assert "import" not in text.split('"""')[-1], f"{wing}/__init__.py should hold only its docstring"


def test_every_wing_index_lists_all_its_modules() -> None:
    """Each wing's `__init__` docstring is its index: it names every module the wing holds (the library
    wings; the tool packages verify, bench, plan and lint document their commands instead)."""
    missing = []
    wings = ("training", "step", "strategy", "parallel", "cluster", "checkpoint", "observe", "data", "tools")
    for init in sorted((ROOT / "ddpkit" / wing / "__init__.py") for wing in wings):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        for module in sorted(init.parent.glob("*.py")):
            if module.name != "__init__.py" and module.stem not in doc:
                missing.append(f"{init.parent.name}/{module.name}")
    assert not missing, f"modules missing from their wing's __init__ docstring: {missing}"
