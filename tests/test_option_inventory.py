"""Every option a user can pass has an entry in tests/options/*.toml naming a test that fails when it is ignored.

The options are found by introspection, never listed by hand, so a new keyword, field or flag fails here until
someone names the test that shows its effect:

- the Python API: the keywords with a default (and keyword-only ones) of `ddpkit.session`, `Session.model`,
  `Session.loader`, `Session.save`, `Session.load`, `Session.export` and `ddpkit.fit`, and the fields of the
  options dataclasses `DDPOptions`, `FSDPOptions`, `HSDPOptions`, `TPOptions` and `SpikeGuard`.
  `Session.save` and `Session.load` pass their keywords on to the checkpoint wing (`**state`), so the keywords of
  `Checkpoints.save` / `Checkpoints.load` count as theirs. Required arguments (the module, the data set, the
  path) are no options; `**dataloader_kwargs` belong to torch's DataLoader.
- the command line: every argument of every `ddpkit` subcommand, found by walking the parser `ddpkit/cli.py`
  builds, through subparsers (`ddpkit bench tune`), into each tool's own parser (the tools parse their own
  arguments: the parser is taken at its `parse_args`, before anything runs), and into a tool's mode with a
  parser of its own (`ddpkit plan --memory`). An option's name is its long spelling (`--nproc`), else its
  short one (`-m`), or a positional's dest; `-h` and options hidden from `--help` are left out.

An entry (the format: a `[[option]]` table with `where`, `name`, `test` and an optional `note`) is refused when
it names an option that does not exist, a test file or function that does not exist, or repeats another.
`python tests/test_option_inventory.py` prints the entries missing, as TOML to fill in.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import inspect
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

import tomllib

REPO = Path(__file__).resolve().parent.parent
INVENTORY = REPO / "tests" / "options"


class Option(NamedTuple):
    where: str  # "session", "Session.model", "DDPOptions", "ddpkit run", "ddpkit shrink weights", ...
    name: str  # the keyword, the field, the flag's long spelling ("--nproc") or a positional's dest


class Entry(NamedTuple):
    option: Option
    test: str
    source: str  # the file that holds it, for the messages


# -- the Python API ---------------------------------------------------------------------------------------


def keyword_options(where: str, *functions: Callable[..., Any]) -> set[Option]:
    """The options of `functions` (one callable and those it passes its `**kwargs` on to): every parameter
    with a default or keyword-only, less `self` and the catch-alls (`*args`, `**kwargs`)."""
    found = set()
    for fn in functions:
        for p in inspect.signature(fn).parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name == "self":
                continue
            if p.default is not p.empty or p.kind is p.KEYWORD_ONLY:
                found.add(Option(where, p.name))
    return found


def field_options(where: str, cls: type) -> set[Option]:
    """The fields of an options dataclass a user can set (those its constructor takes)."""
    return {Option(where, f.name) for f in dataclasses.fields(cls) if f.init}


def api_options() -> set[Option]:
    import ddpkit
    from ddpkit.checkpoint.checkpoints import Checkpoints
    from ddpkit.step.spikes import SpikeGuard
    from ddpkit.strategy import DDPOptions, FSDPOptions
    from ddpkit.strategy.hsdp_options import HSDPOptions
    from ddpkit.strategy.tp_options import TPOptions
    from ddpkit.training.session import Session

    callables: dict[str, tuple[Callable[..., Any], ...]] = {
        "session": (ddpkit.session,),
        "Session.model": (Session.model,),
        "Session.loader": (Session.loader,),
        "Session.save": (Session.save, Checkpoints.save),  # s.save(path, **state) -> Checkpoints.save
        "Session.load": (Session.load, Checkpoints.load),
        "Session.export": (Session.export,),
        "fit": (ddpkit.fit,),
    }
    classes = {"DDPOptions": DDPOptions, "FSDPOptions": FSDPOptions, "HSDPOptions": HSDPOptions}
    classes["SpikeGuard"] = SpikeGuard
    classes["TPOptions"] = TPOptions
    found = set().union(*(keyword_options(w, *fns) for w, fns in callables.items()))
    return found.union(*(field_options(w, cls) for w, cls in classes.items()))


# -- the command line -------------------------------------------------------------------------------------


def _public(action: argparse.Action) -> bool:
    return not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) and (
        action.help != argparse.SUPPRESS
    )


def _name(action: argparse.Action) -> str:
    long = [s for s in action.option_strings if s.startswith("--")]
    return (long or action.option_strings or [action.dest])[0]


def parser_options(where: str, parser: argparse.ArgumentParser) -> set[Option]:
    """Every public argument of `parser` itself, at `where` (its subcommands are commands of their own)."""
    return {Option(where, _name(a)) for a in parser._actions if _public(a)}


def cli_options(build: Callable[[], argparse.ArgumentParser] | None = None) -> set[Option]:
    """The options of `ddpkit <sub> ...`, with each tool's own parser in place of its placeholder: every
    command `ddpkit.cli.commands` walks (the walk the command-line reference renders too)."""
    from ddpkit import cli

    return set().union(*(parser_options(c.where, c.parser) for c in cli.commands(build)))


# -- the inventory ----------------------------------------------------------------------------------------


def read_entries(folder: Path = INVENTORY) -> tuple[list[Entry], list[str]]:
    """Every entry of `folder/*.toml`, and what is malformed (a table without its where, name or test)."""
    entries, problems = [], []
    for path in sorted(folder.glob("*.toml")):
        source = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)
        for i, table in enumerate(tomllib.loads(path.read_text()).get("option", [])):
            missing = [k for k in ("where", "name", "test") if not isinstance(table.get(k), str)]
            if missing:
                problems.append(f"{source}: option #{i + 1} ({table}) has no {', '.join(missing)} (a string)")
                continue
            entries.append(Entry(Option(table["where"], table["name"]), table["test"], source))
    return entries, problems


@cache
def _test_functions(path: Path) -> frozenset[str]:
    """`name` and `Class::name` of every test function in the file."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names |= {f"{node.name}::{f.name}" for f in node.body if isinstance(f, ast.FunctionDef)}
    return frozenset(n for n in names if n.rpartition("::")[2].startswith("test"))


def missing_test(ref: str, root: Path = REPO) -> str | None:
    """Why the node id `ref` ("tests/test_x.py::test_name", a parametrized id's brackets allowed) names no
    test; None when it does."""
    path, sep, function = ref.partition("::")
    if not sep or not function:
        return f"{ref!r} is not a node id (tests/test_x.py::test_name)"
    if not (root / path).is_file():
        return f"{path} does not exist"
    name = re.sub(r"\[.*\]$", "", function)
    if name not in _test_functions(root / path):
        return f"{path} has no test function {name}"
    return None


def problems(options: set[Option], entries: Iterable[Entry], root: Path = REPO) -> list[str]:
    """What is wrong between the options found and the entries given: an option without an entry, an entry
    for no such option, an entry whose test does not exist, an entry given twice."""
    entries = list(entries)
    out = []
    seen: dict[Option, Entry] = {}
    for e in entries:
        where = f"{e.source}: {e.option.where} {e.option.name}"
        if e.option in seen:
            out.append(f"{where}: given twice (also in {seen[e.option].source})")
        seen.setdefault(e.option, e)
        if e.option not in options:
            out.append(f"{where}: no such option")
        why = missing_test(e.test, root)
        if why:
            out.append(f"{where}: its test {e.test!r} does not exist: {why}")
    for option in sorted(options - set(seen)):
        out.append(f"{option.where} {option.name}: no entry in tests/options/*.toml names its test")
    return out


def _is_cli(where: str) -> bool:
    return where == "ddpkit" or where.startswith("ddpkit ")


def _report(found: list[str]) -> str:
    return f"{len(found)} problem(s) in the option inventory:\n  " + "\n  ".join(found)


def test_every_python_api_option_has_an_entry_naming_a_test_that_exists() -> None:
    entries, malformed = read_entries()
    found = malformed + problems(api_options(), [e for e in entries if not _is_cli(e.option.where)])
    assert not found, _report(found)


def test_every_cli_option_has_an_entry_naming_a_test_that_exists() -> None:
    entries, _ = read_entries()
    found = problems(cli_options(), [e for e in entries if _is_cli(e.option.where)])
    assert not found, _report(found)


# -- the inventory test can fail ----------------------------------------------------------------------------


def _fake_entry(where: str, name: str, test: str) -> Entry:
    return Entry(Option(where, name), test, "fake.toml")


def test_an_option_added_without_an_entry_is_reported(tmp_path: Path) -> None:
    """A new keyword, a new field and a new flag each fail the inventory until an entry names its test; a
    stale entry, a test that does not exist and a repeated entry are reported too."""

    def model(self: Any, module: Any, *, strategy: Any = None, new_keyword: int = 1, **kw: Any) -> None: ...

    @dataclasses.dataclass
    class Options:
        known: int = 0
        new_field: bool = False

    def build() -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser(prog="ddpkit")
        sub = parser.add_subparsers(dest="command")
        convert = sub.add_parser("shrink").add_subparsers(dest="action").add_parser("weights")
        convert.add_argument("source")
        convert.add_argument("--to")
        convert.add_argument("--new-flag", action="store_true")
        convert.add_argument("--hidden", help=argparse.SUPPRESS)
        return parser

    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_fake.py").write_text(
        "def test_fake():\n    pass\n\ndef helper():\n    pass\n"
    )
    test = "tests/test_fake.py::test_fake"
    options = keyword_options("Session.model", model) | field_options("Options", Options)
    options |= cli_options(build)
    assert options == {
        Option("Session.model", "strategy"),
        Option("Session.model", "new_keyword"),
        Option("Options", "known"),
        Option("Options", "new_field"),
        Option("ddpkit shrink weights", "source"),
        Option("ddpkit shrink weights", "--to"),
        Option("ddpkit shrink weights", "--new-flag"),
    }
    known = [
        _fake_entry("Session.model", "strategy", test),
        _fake_entry("Options", "known", test),
        _fake_entry("ddpkit shrink weights", "source", f"{test}[2-4]"),
        _fake_entry("ddpkit shrink weights", "--to", test),
    ]
    assert problems(options, known, tmp_path) == [
        "Options new_field: no entry in tests/options/*.toml names its test",
        "Session.model new_keyword: no entry in tests/options/*.toml names its test",
        "ddpkit shrink weights --new-flag: no entry in tests/options/*.toml names its test",
    ]
    wrong = [
        _fake_entry("Session.model", "gone", test),
        _fake_entry("Options", "new_field", "tests/test_fake.py::helper"),
        _fake_entry("Session.model", "new_keyword", "tests/test_nowhere.py::test_fake"),
        _fake_entry("ddpkit shrink weights", "--new-flag", test),
        _fake_entry("ddpkit shrink weights", "--new-flag", test),
    ]
    assert problems(options, known + wrong, tmp_path) == [
        "fake.toml: Session.model gone: no such option",
        "fake.toml: Options new_field: its test 'tests/test_fake.py::helper' does not exist: "
        "tests/test_fake.py has no test function helper",
        "fake.toml: Session.model new_keyword: its test 'tests/test_nowhere.py::test_fake' does not exist: "
        "tests/test_nowhere.py does not exist",
        "fake.toml: ddpkit shrink weights --new-flag: given twice (also in fake.toml)",
    ]


def test_the_tools_parsers_and_their_modes_are_walked() -> None:
    """`ddpkit plan` is a placeholder in cli.py's parser: its options come from the tool's own parser, and
    `ddpkit plan --memory`'s from the parser of that mode; `ddpkit bench tune` is a subcommand's."""
    options = cli_options()
    wheres = {o.where for o in options}
    assert {"ddpkit run", "ddpkit demo", "ddpkit plan", "ddpkit plan --memory", "ddpkit bench tune"} <= wheres
    assert {"ddpkit checkpoint inspect", "ddpkit checkpoint convert", "ddpkit doctor"} <= wheres
    assert Option("ddpkit run", "--nproc") in options and Option("ddpkit run", "target") in options
    assert Option("ddpkit plan --memory", "--shard-degree") in options
    assert not [
        o for o in options if o.name in ("tool_args", "--help", "--memory") and o.where != "ddpkit plan"
    ]


def _skeleton(missing: Iterator[Option]) -> str:
    return "\n".join(
        f'[[option]]\nwhere = "{o.where}"\nname = "{o.name}"\ntest = ""\n' for o in sorted(missing)
    )


if __name__ == "__main__":  # the entries still missing, as TOML to fill in
    entries, _ = read_entries()
    named = {e.option for e in entries}
    with contextlib.redirect_stdout(sys.stderr):
        every = api_options() | cli_options()
    print(_skeleton(o for o in every if o not in named))
