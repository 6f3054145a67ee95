"""Notebooks executed top to bottom in a real Jupyter kernel (nbclient + ipykernel), as a person would
run them: `ddpkit.spawn` with functions defined in cells (tests/notebooks/), and the course labs
(examples/notebooks/). Outputs are not committed; each cell is bounded by a timeout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, python

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")


def execute(
    path: Path, cwd: Path, cell_timeout: int = 100, budget: float = 105, parameters: str = ""
) -> tuple[object, float]:
    """Run every cell in a fresh kernel whose ddpkit is this checkout; the executed notebook, seconds.

    `parameters`: code run right after the notebook's cell tagged "parameters" (as papermill injects
    it), to set what the notebook says a reader may change. Each cell gets at most `cell_timeout`
    seconds and the notebook at most `budget` in all, under pytest's timeout, so that nbclient's
    timeout (which also shuts the kernel and its ranks down) fires first."""
    nb = nbformat.read(path, as_version=4)
    if parameters:
        tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
        assert len(tagged) == 1, f"{path.name}: one cell tagged 'parameters' expected, found {len(tagged)}"
        injected = nbformat.v4.new_code_cell(parameters)
        injected.metadata["tags"] = ["injected-parameters"]
        nb.cells.insert(tagged[0] + 1, injected)
    client = nbclient.NotebookClient(
        nb, timeout=cell_timeout, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}
    )
    start = time.perf_counter()
    with client.setup_kernel(env=kernel_env(cwd)):
        for index, cell in enumerate(nb.cells):
            left = budget - (time.perf_counter() - start)
            client.timeout = max(1, int(min(cell_timeout, left)))
            client.execute_cell(cell, index)
    return nb, time.perf_counter() - start


def kernel_env(cwd: Path) -> dict[str, str]:
    """This process's environment, with this checkout put first on PYTHONPATH only where a new interpreter
    in `cwd` would import another ddpkit (an installed copy): left unchanged, it is the warm server's
    (conftest `python()`), so that the commands a lab runs through it are forked from it rather than
    answered "fresh" for a differing load-time variable (PYTHONPATH is one)."""
    find = "import importlib.util as u; print(u.find_spec('ddpkit').origin)"
    origin = subprocess.run(
        [sys.executable, "-c", find], cwd=cwd, capture_output=True, text=True, check=True
    ).stdout.strip()
    if Path(origin).resolve() == (REPO / "ddpkit" / "__init__.py").resolve():
        return dict(os.environ)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def text_of(nb) -> str:
    return "\n".join(
        out.get("text", "") or str(out.get("data", {}).get("text/plain", ""))
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
    )


def test_spawn_runs_functions_defined_in_notebook_cells_and_names_a_failing_rank(tmp_path: Path) -> None:
    nb, _ = execute(REPO / "tests" / "notebooks" / "spawn_from_a_cell.ipynb", tmp_path)
    out = text_of(nb)
    assert "results in rank order: [(0, 2, 30.0), (1, 2, 30.0)]" in out
    assert "a lambda runs too" in out
    assert "rank 1 of 2 failed:" in out


LABS = REPO / "examples" / "notebooks"


# What each lab says a reader may change, set so that the test proves the lab runs top to bottom and
# prints its conclusion in seconds: lab 2 measures a narrower MLP (tests/notebooks/lab_workloads.py, put in
# the lab's folder as a reader's own workload module would be; the same shape at 2.1M parameters instead
# of 38M) over shorter blocks, and runs its `ddpkit` commands with the suite's interpreter (`python()`:
# the warm server's client, so each command is forked from a process that imported torch once instead of
# paying that import; its ranks are new interpreters either way). The reader's run keeps the defaults.
LAB_PARAMETERS = {
    "02_one_process_vs_n_ranks.ipynb": 'WORKLOAD = "lab_workloads:narrow_mlp"\nSTEPS = 3\nBLOCK_SECONDS = 0.1',
}
LAB_FILES = {"02_one_process_vs_n_ranks.ipynb": [REPO / "tests" / "notebooks" / "lab_workloads.py"]}


@pytest.mark.parametrize(
    ("name", "expect"),
    [
        (
            "01_ddp_equals_one_process.ipynb",
            "verified: DDP on 2 ranks trains the same weights as one process",
        ),
        ("02_one_process_vs_n_ranks.ipynb", "hidden behind backward"),
        ("03_collectives_tour.ipynb", "rank 1 of 2 failed"),
    ],
)
@pytest.mark.timeout(300)
def test_the_course_labs_run_top_to_bottom(tmp_path: Path, name: str, expect: str) -> None:
    # The labs run real benchmarks and traces (fresh launches of 1 and 2 ranks). The bounds guard against a
    # hang, not the machine's speed: 240 s a cell, 270 s in all, under pytest's 300 s.
    parameters = LAB_PARAMETERS.get(name, "")
    if parameters:
        parameters += f"\nPYTHON = {python()!r}"
    for path in LAB_FILES.get(name, []):
        shutil.copy(path, tmp_path)
    nb, seconds = execute(LABS / name, tmp_path, cell_timeout=240, budget=270, parameters=parameters)
    out = text_of(nb)
    assert expect in out
    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert images or name.startswith("03"), "the lab's pictures are shown inline"
    if parameters:
        assert "mlp-narrow" in out, "the injected parameters reached the lab's commands"
    print(f"{name}: {seconds:.1f} s")


def test_the_committed_notebooks_carry_no_outputs() -> None:
    """Outputs come from a run on the reader's machine, not from the repository."""
    for path in [*LABS.glob("*.ipynb"), *(REPO / "tests" / "notebooks").glob("*.ipynb")]:
        nb = nbformat.read(path, as_version=4)
        stale = [
            i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)
        ]
        assert not stale, (
            f"{path.name}: cells {stale} hold outputs; clear them (jupyter nbconvert --clear-output)"
        )


def test_forked_ranks_refuse_more_than_one_thread_with_the_fix() -> None:
    import ddpkit

    with pytest.raises(ddpkit.DdpkitError, match=r"threads=2 with forked ranks: GNU OpenMP hangs"):
        ddpkit.spawn(lambda: 1, nproc=2, threads=2)


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def test_forked_ranks_run_one_thread_whatever_omp_num_threads_says(monkeypatch: pytest.MonkeyPatch) -> None:
    # A function defined in a cell is forked; GNU OpenMP hangs a forked child that runs more threads
    # after the parent used its pool, so each forked rank gets one thread even when the environment
    # asks for two (a lambda: not importable by name, so forked like a notebook cell's function).
    import ddpkit

    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert ddpkit.spawn(lambda: _threads(), nproc=2) == [1, 1]
