"""The selections CI and developers run instead of the whole suite cannot silently lose a test.

`.ci/run` runs the whole suite once on this CPU's kernels, then only the tests marked `numerics` again
under `ATEN_CPU_CAPABILITY=default` (torch's portable kernels): a result exact only on one CPU's vector
path must fail there. A test that compares floats between computations but lacks the mark would never
meet the portable kernels. So every test whose source (with the module's helper functions it reaches)
holds a sign of a float comparison carries the mark, or is listed in NOT_KERNEL_DEPENDENT with the reason
its result cannot depend on the kernel path. The signs are textual (a comparison made only inside another
module or with a bare `==` is not seen): the list catches the usual ways, not every way.

`pytest -m quick` (the inner loop, tests/conftest.py QUICK) must keep touching every wing of ddpkit/.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import QUICK, REPO

TESTS = REPO / "tests"
# Signs that a test compares floats: equality of tensors, a tolerance, the calibrated noise floor, a
# bitwise claim, a `ddpkit verify` run (DDP against one process within the calibrated floor).
SIGNS = re.compile(
    r"torch\.equal|allclose|assert_close|isclose|approx\(|calibrat|noise.floor|bitwise|tolerance|atol|rtol"
    r"|deviation|max_abs|\bverify\b"
)
_SAME_BY_CONSTRUCTION = "a resumed run repeats the uninterrupted run's own operations: equal on any kernel"
# Tests (file, or file::test) whose float comparisons cannot depend on the kernel path, and why.
NOT_KERNEL_DEPENDENT = {
    "test_anatomy.py": "timings and their arithmetic; no trained values compared",
    "test_bench.py": "benchmark arithmetic (floors, spreads) on measured or given numbers",
    "test_checkpoint.py": "save/load round trips: the same bytes come back",
    "test_checkpoint_tools.py": "conversions return the saved bytes; forwards compared in one process on the same weights",
    "test_checkpoint_portable.py": "a load copies the saved values: the loaded state equals the saved bytes",
    "test_checkpoint_remote.py": "downloaded checkpoints equal the uploaded bytes; the preempted run: " + _SAME_BY_CONSTRUCTION,
    "test_ci_selection.py": "this check's own sample of a float comparison",
    "test_data_hf.py": _SAME_BY_CONSTRUCTION,
    "test_fit.py": "logged values read back as written",
    "test_gpucheck.py": "names of checks; nothing computed",
    "test_hf_weights.py": "weights loaded from a checkpoint equal its bytes",
    "test_plan.py": "the planner's cost model in Python floats; no torch kernel",
    "test_plugins.py::test_a_strategy_registered_from_outside_trains_with_its_shape":
        "replicas compared with each other: every rank applies the same all-reduced gradient",
    "test_architecture.py::test_every_wing_index_lists_all_its_modules": "module names in docstrings; nothing computed",
    "test_plan_noise.py": "the planner's noise bands in Python floats; no torch kernel",
    "test_plan_memory.py": "bytes of fake tensors (shapes and dtypes): no kernel computes a value",
    "test_plan_memory_ranks.py": "a peak in bytes measured by the kernel against the estimate; no trained value compared",
    "test_preemption.py": _SAME_BY_CONSTRUCTION,
    "test_public_api.py": "command-line options only",
    "test_run_reports.py": "launch reports; no values compared",
    "test_strategy_choice.py": "byte counts of optimizer state",
    "test_tracking.py": "logged values read back as written",
    "test_activation_checkpointing.py::test_a_block_fed_the_raw_batch_still_trains": "weights changed at all",
    "test_activation_checkpointing.py::test_auto_finds_an_hf_models_blocks_and_loads_weights_through_the_wrappers": (
        "loaded weights equal the saved bytes"
    ),
    "test_data_streams.py::test_stopped_mid_epoch_and_resumed_ends_bitwise_like_uninterrupted": _SAME_BY_CONSTRUCTION,
    "test_data_streams.py::test_killed_mid_epoch_and_restarted_ends_bitwise_like_uninterrupted": _SAME_BY_CONSTRUCTION,
    "test_lint_new_rules.py::test_the_checkpointing_trap_is_real_on_gloo_ranks": (
        "shows a hang/refusal of the trap, not two computations' values"
    ),
    "test_tokens.py::test_a_step_without_any_valid_token_is_skipped_on_every_rank": "weights left unchanged",
    "test_verify_resume.py::test_a_checkpoint_of_everything_resumes_bitwise": _SAME_BY_CONSTRUCTION,
    "test_verify_resume.py::test_the_command_line": "the same world size: " + _SAME_BY_CONSTRUCTION,
}


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
        if signs and "numerics" not in marks
        and test not in NOT_KERNEL_DEPENDENT and test.split("::")[0] not in NOT_KERNEL_DEPENDENT
    ]  # fmt: skip
    assert not left_out, (
        "these tests compare floats but are not marked `numerics`, so .ci/run never runs them on the "
        "portable kernels: mark them @pytest.mark.numerics, or list them in NOT_KERNEL_DEPENDENT "
        "(tests/test_ci_selection.py) with the reason their result cannot depend on the kernel path:\n"
        + "\n".join(left_out)
    )
    stale = [
        key
        for key in NOT_KERNEL_DEPENDENT
        if "::" in key and (key not in found or "numerics" in found[key][0])
    ]
    assert not stale, f"NOT_KERNEL_DEPENDENT names tests that are gone or marked `numerics`: {stale}"


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
