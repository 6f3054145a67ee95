"""The lean install: what the core depends on, the extras that bring the demo's and the plots' packages, the
one paragraph a user gets without them, and `ddpkit --version`. (The wheel in a clean environment, with
`ddpkit doctor` and the quickstart, is CI's install leg in .ci/run.)"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import tomllib

from ddpkit import cli
from ddpkit.errors import DdpkitError
from ddpkit.tools import demo, plotting

ROOT = Path(__file__).resolve().parent.parent


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_the_core_depends_only_on_what_training_needs() -> None:
    names = {d.split(">")[0].split("=")[0].split("[")[0].strip() for d in _project()["dependencies"]}
    assert names == {"torch", "numpy", "tqdm", "safetensors"}


def test_the_demo_and_plots_extras_bring_their_packages_and_the_test_set_up_installs_them() -> None:
    extras = _project()["optional-dependencies"]
    assert any(d.startswith("scikit-learn") for d in extras["demo"]) and "ddpkit[plots]" in extras["demo"]
    assert any(d.startswith("matplotlib") for d in extras["plots"])
    assert any("demo" in d for d in extras["test"] if d.startswith("ddpkit["))


def test_the_demo_without_scikit_learn_names_the_extra(monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "sklearn" else real(name, *a)
    )
    with pytest.raises(
        DdpkitError, match=r"the demo needs scikit-learn, which is not installed.*ddpkit\[demo\]"
    ):
        demo.require_demo_packages()


def test_a_figure_without_matplotlib_names_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # an import of it raises ImportError
    with pytest.raises(DdpkitError, match=r"needs matplotlib, which is not installed.*ddpkit\[plots\]"):
        plotting.pyplot()


def test_version_prints_the_installed_version(capsys) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"ddpkit {version('ddpkit')}"
