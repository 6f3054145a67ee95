"""The selections CI and developers run instead of the whole suite cannot silently lose a test.

`.ci/run` runs the whole suite once on this CPU's kernels, then the tests marked `numerics` again under
`ATEN_CPU_CAPABILITY=default` (torch's portable kernels), less those tests/conftest.py's
NOT_KERNEL_DEPENDENT lists with the reason their result cannot depend on the kernel path (a listed test
in a module marked `numerics` as a whole gets `kernel_independent`): a result exact only on one CPU's
vector path must fail there. A test that compares floats between computations but lacks the mark would
never meet the portable kernels. So every test whose source (with the module's helper functions it
reaches) holds a sign of a float comparison carries the mark, or is listed. The signs are textual (a comparison made only inside another
module or with a bare `==` is not seen): the list catches the usual ways, not every way.

`pytest -m quick` (the inner loop, tests/conftest.py QUICK) must keep touching every wing of ddpkit/.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from conftest import (
    MODULE_SECONDS,
    NOT_KERNEL_DEPENDENT,
    QUICK,
    REPO,
    WORKERS_ENV,
    auto_workers,
    kernel_independent,
    longest_first,
)

TESTS = REPO / "tests"
# Signs that a test compares floats: equality of tensors, a tolerance, the calibrated noise floor, a
# bitwise claim, a `ddpkit verify` run (DDP against one process within the calibrated floor).
SIGNS = re.compile(
    r"torch\.equal|allclose|assert_close|isclose|approx\(|calibrat|noise.floor|bitwise|tolerance|atol|rtol"
    r"|deviation|max_abs|\bverify\b"
)


def _marks(nodes: list[ast.expr]) -> set[str]:
    return {m for node in nodes for m in re.findall(r"pytest\.mark\.(\w+)", ast.unparse(node))}


def signs_by_test() -> dict[str, tuple[set[str], set[str]]]:
    """{"file::test": (its marks, the signs in its source and the module functions it reaches)}."""
    found = {}
    for path in sorted(TESTS.glob("test_*.py")):
        tree = ast.parse(path.read_text())
        functions = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        module_marks = set()
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                getattr(t, "id", None) == "pytestmark" for t in node.targets
            ):
                module_marks |= _marks([node.value])
        for name, fn in functions.items():
            if not name.startswith("test_"):
                continue
            seen, todo, text = set(), [fn], []
            while todo:
                node = todo.pop()
                if node.name in seen:
                    continue
                seen.add(node.name)
                text.append(ast.unparse(node))
                todo += [
                    functions[n.id] for n in ast.walk(node) if isinstance(n, ast.Name) and n.id in functions
                ]
            signs = set(SIGNS.findall("\n".join(text)))
            found[f"{path.name}::{name}"] = (module_marks | _marks(fn.decorator_list), signs)
    return found


def test_every_float_comparison_runs_under_the_portable_kernels_or_says_why_not() -> None:
    found = signs_by_test()
    left_out = [
        f"{test} ({', '.join(sorted(signs))})"
        for test, (marks, signs) in found.items()
        if signs
        and "numerics" not in marks
        and test not in NOT_KERNEL_DEPENDENT
        and test.split("::")[0] not in NOT_KERNEL_DEPENDENT
    ]
    assert not left_out, (
        "these tests compare floats but are not marked `numerics`, so .ci/run never runs them on the "
        "portable kernels: mark them @pytest.mark.numerics, or list them in NOT_KERNEL_DEPENDENT "
        "(tests/conftest.py) with the reason their result cannot depend on the kernel path:\n"
        + "\n".join(left_out)
    )
    files = {test.split("::")[0] for test in found}
    stale = [key for key in NOT_KERNEL_DEPENDENT if key not in found and key not in files]
    assert not stale, f"NOT_KERNEL_DEPENDENT names tests that are gone: {stale}"


def test_a_listed_test_leaves_the_default_kernel_leg_and_no_other_does() -> None:
    """The leg runs `-m "numerics and not kernel_independent"`: a listed file or test (any parametrisation)
    is marked kernel_independent, also inside a module marked `numerics` as a whole; an unlisted one is not."""
    assert kernel_independent(
        "tests/test_elastic.py::test_a_lost_host_and_the_job_finishes_on_the_other[step]"
    )
    assert kernel_independent("tests/test_verify.py::test_spec_errors")
    assert not kernel_independent(
        "tests/test_verify.py::test_adamw_transformer_stays_within_the_calibrated_floor"
    )
    assert not kernel_independent(
        "tests/test_invariant.py::test_mlp_cnn_and_gpt_train_the_same_weights_on_1_2_and_4_ranks"
    )


def test_the_sign_scan_sees_a_float_comparison(tmp_path: Path) -> None:
    """The check can fail: an unmarked equality test is found, a marked one is not."""
    sample = "def helper(a, b):\n    return torch.equal(a, b)\n\ndef test_x():\n    assert helper(1, 2)\n"
    tree = ast.parse(sample)
    text = "\n".join(ast.unparse(n) for n in tree.body)
    assert SIGNS.findall(text) == ["torch.equal"]
    found = signs_by_test()
    marked = found["test_verify.py::test_adamw_transformer_stays_within_the_calibrated_floor"]
    assert "numerics" in marked[0] and marked[1]


def test_every_wing_has_quick_tests() -> None:
    wings = {p.parent.name for p in (REPO / "ddpkit").glob("*/__init__.py")} | {""}
    assert wings <= set(QUICK), (
        f"wings without a quick test (tests/conftest.py QUICK): {sorted(wings - set(QUICK))}"
    )
    assert set(QUICK) <= wings, f"QUICK names wings that are gone: {sorted(set(QUICK) - wings)}"


def test_every_quick_entry_names_a_test() -> None:
    missing = []
    for entry in (e for entries in QUICK.values() for e in entries):
        file, name = entry.split("[", 1)[0].split("::")
        path = TESTS / file
        if not path.exists() or not re.search(rf"^def {name}\(", path.read_text(), re.M):
            missing.append(entry)
    assert not missing, f"QUICK entries that name no test: {missing}"


def test_ci_runs_the_readmes_test_command_verbatim() -> None:
    """Users and CI run the same suite: `.ci/run` calls the README's command as it is written there."""
    command = "scripts/setup.sh && .venv/bin/python -m pytest -q"
    assert f"{command}     #" in (REPO / "README.md").read_text()
    assert any(line.strip().startswith(command) for line in (REPO / ".ci" / "run").read_text().splitlines())


def test_the_whole_suite_runs_on_a_worker_per_core_and_named_tests_in_one_process() -> None:
    """`pytest -q` (pyproject's `-n auto`) spreads the suite over the cores; a developer's named file or
    test, and the mutation check's runs, stay in one process (no worker start-up, `-s` and `--pdb` work)."""
    assert auto_workers(["tests"], REPO, cores=2, env={}) == 2  # the README's command: testpaths
    assert auto_workers([], REPO, cores=2, env={}) == 2
    assert auto_workers(["tests"], REPO, cores=64, env={}) == 4
    assert auto_workers(["tests"], REPO, cores=1, env={}) == 0
    assert auto_workers(["tests/test_verify.py"], REPO, cores=2, env={}) == 0
    assert auto_workers(["tests/test_verify.py::test_x", "tests"], REPO, cores=2, env={}) == 0
    assert auto_workers(["tests"], REPO, cores=2, env={}, marks="quick") == 0  # the inner loop
    assert auto_workers(["tests"], REPO, cores=2, env={}, marks="numerics and not kernel_independent") == 2
    assert auto_workers(["tests"], REPO, cores=2, env={WORKERS_ENV: "3"}) == 3
    assert (
        "-n auto --dist loadfile" in (REPO / "pyproject.toml").read_text()
    )  # the hook is what `-n auto` asks


def test_the_workers_take_the_longest_modules_first_and_the_table_names_real_modules() -> None:
    """Left to xdist's order (most tests first), the few-test modules that take longest came last and one
    worker ran them alone at the end; tests/conftest.py hands modules out by tests/module_seconds.json."""
    seconds = json.loads(MODULE_SECONDS.read_text())
    assert set(seconds) <= {path.name for path in TESTS.glob("test_*.py")}, "module_seconds.json: stale names"
    assert seconds["test_memory_limit.py"] > seconds["test_public_api.py"]  # the 4-rank proof goes out early
    pending = ["tests/test_public_api.py", "tests/test_memory_limit.py", "tests/test_brand_new.py"]
    assert longest_first(seconds, pending) == "tests/test_memory_limit.py"
    table = {"test_a.py": 1.0, "test_b.py": 5.0, "test_c.py": 9.0}
    assert longest_first(table, ["tests/test_a.py", "tests/test_new.py"]) == "tests/test_new.py"  # the median
    assert longest_first(table, ["tests/test_a.py", "tests/test_c.py::Class"]) == "tests/test_c.py::Class"


def _mutation_check():
    import importlib.util

    spec = importlib.util.spec_from_file_location("mutation_check", REPO / "scripts" / "mutation_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["mutation_check"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_ci_runs_every_mutant_whose_record_does_not_cover_it(tmp_path: Path, monkeypatch) -> None:
    """CI's mutation leg runs only the *due* mutants (plus a budget of others): a mutant is due when it is new
    or edited, when its record's commit is unknown, or when one of its files changed since that commit."""
    mc = _mutation_check()
    calm, hit, helped, edited, lost, unrecorded = mc.MUTANTS[:6]
    entry = {"date": "2026-11-28"}
    record = {
        calm.name: {**entry, "digest": mc.digest(calm), "commit": "c1"},
        hit.name: {**entry, "digest": mc.digest(hit), "commit": "c2"},
        helped.name: {**entry, "digest": mc.digest(helped), "commit": "c4"},
        edited.name: {**entry, "digest": "another mutant", "commit": "c1"},
        lost.name: {**entry, "digest": mc.digest(lost), "commit": "c3"},
    }
    helper = "tests/hsdp_ranks.py"  # a helper module a test file imports counts as the test's
    helped = mc.Mutant(
        helped.name,
        helped.file,
        helped.old,
        helped.new,
        ("tests/test_hsdp.py::test_hsdp_2x2_trains_the_weights_of_one_process",),
        helped.what,
    )
    record[helped.name]["digest"] = mc.digest(helped)
    changes = {"c1": {"README.md"}, "c2": {hit.file}, "c4": {helper}, "c3": None}
    monkeypatch.setattr(mc, "RECORD", tmp_path / "record.json")
    monkeypatch.setattr(mc, "changed_since", changes.__getitem__)
    mc.RECORD.write_text(mc.json.dumps(record))
    picked, why = mc.due([calm, hit, helped, edited, lost, unrecorded])
    assert [m.name for m in picked] == [hit.name, helped.name, edited.name, lost.name, unrecorded.name], why
    assert "c3" in why


def test_every_mutants_target_text_occurs_once_in_its_file() -> None:
    """A change that moves a mutant's target text would stop the mutation leg after the whole suite has run:
    caught here, in the suite, with the mutants named."""
    mc = _mutation_check()
    moved = [
        f"{m.name} ({m.file}: {(REPO / m.file).read_text().count(m.old)} times)"
        for m in mc.MUTANTS
        if (REPO / m.file).read_text().count(m.old) != 1
    ]
    assert not moved, "mutants whose target text is not in their file exactly once: " + ", ".join(moved)
    missing = [
        f"{m.name}: {t}" for m in mc.MUTANTS for t in m.tests if not (REPO / t.split("::")[0]).is_file()
    ]
    assert not missing, "mutants naming test files that do not exist: " + ", ".join(missing)


def test_the_set_up_compiles_what_a_run_imports_and_the_suite_writes_the_rest() -> None:
    """scripts/setup.sh compiles (where no bytecode is written) ddpkit's requirements and theirs, not the
    extras' packages; those are compiled once by the suite, which writes bytecode for what it imports."""
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "runtime_packages.py")],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.split()
    names = {Path(p).name.removesuffix(".py") for p in out}
    assert {"torch", "numpy", "sympy", "tqdm", "safetensors"} <= names, sorted(names)
    assert not names & {"transformers", "moto", "mlflow", "wandb", "pytest", "ddpkit"}, sorted(names)
    assert all(Path(p).exists() for p in out)
    assert not sys.dont_write_bytecode and "PYTHONDONTWRITEBYTECODE" not in os.environ
