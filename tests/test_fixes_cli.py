"""Commands that failed with a traceback per rank: `ddpkit bench collectives --nproc 1` and `ddpkit trace
--hook NAME` of a hook that does not exist, both refused in one line before any rank starts; and the
command-line reference and the option inventory reading the parsers through one walk (`cli.commands`)."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import ddpkit
from ddpkit import cli

REPO = Path(__file__).resolve().parent.parent


def _no_ranks(*args, **kwargs):
    raise AssertionError("a rank was started: the refusal comes before any")


def test_bench_collectives_on_one_rank_is_refused_in_one_line(capsys, monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(ddpkit, "spawn", _no_ranks)
    for nproc in ("1", "2,1"):
        argv = ["bench", "collectives", "--nproc", nproc, "--max-size", "16KB", "--out", str(tmp_path)]
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and err.startswith("ddpkit bench collectives: error: --nproc"), err
        assert "one rank has none to move" in err and "Pass 2 or more ranks" in err, err


def test_trace_refuses_an_unknown_hook_once_naming_the_known_ones(capsys, monkeypatch, tmp_path) -> None:
    from ddpkit.tools import trace

    monkeypatch.setattr(ddpkit, "spawn", _no_ranks)
    assert cli.main(["trace", "--hook", "fp17", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("ddpkit trace: error: --hook 'fp17'"), err
    assert "allreduce, bf16, fp16, powersgd, shm" in err, err
    for known in ("allreduce", "fp16", "bf16", "powersgd", "shm"):
        trace._check_hook(known)
    assert cli.main(["trace", "--hook", "fp16", "--strategy", "fsdp", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()  # ignored under FSDP before: refused, naming both flags
    assert "\n" not in err and "--strategy fsdp has no communication hook" in err, err
    assert "Drop --hook" in err, err
    trace._check_hook("allreduce", "fsdp")  # the default hook is no choice: FSDP is traced as it is


def test_the_reference_and_the_inventory_read_the_parsers_through_one_walk(monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "100")  # the reference sets it; restored after the test
    own_walk = {
        "captured_parser",
        "_Parsed",
        "_subcommands",
        "_summaries",
        "_shape",
        "_modes",
        "tool_parsers",
    }
    for path in (REPO / "scripts" / "docs_cli.py", REPO / "tests" / "test_option_inventory.py"):
        tree = ast.parse(path.read_text())
        defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        assert not defined & own_walk, f"{path.name} walks the parsers itself: {sorted(defined & own_walk)}"
        assert "cli.commands(" in path.read_text(), path.name
    spec = importlib.util.spec_from_file_location("docs_cli", REPO / "scripts" / "docs_cli.py")
    docs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(docs)  # type: ignore[union-attr]
    import test_option_inventory as inventory

    walked = [c.where for c in cli.commands()]
    titles = re.findall(r"^#+ `(ddpkit [^`]+)`$", docs.render(), re.M)
    assert titles == walked and len(set(walked)) == len(walked)
    assert {"ddpkit bench tune", "ddpkit plan --memory", "ddpkit checkpoint convert"} <= set(walked)
    assert {o.where for o in inventory.cli_options()} <= set(walked)
