"""The command-line reference, rendered from the parsers themselves: an MkDocs hook (mkdocs.yml `hooks:`).

A page that holds the line `<!-- cli-reference -->` gets, in its place, one section per `ddpkit` command:
its summary and its `--help`, for every subcommand (`ddpkit bench tune`) and every tool mode with a parser of
its own (`ddpkit plan --memory`). The tools build their parsers inside their `main` (their modules import
only when asked for), so a parser is taken at its `parse_args`, before anything of the tool runs: the page
cannot drift from what `ddpkit X --help` prints. `python scripts/docs_cli.py` prints the same Markdown.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

MARK = "<!-- cli-reference -->"
HELP_WIDTH = "100"  # argparse reads COLUMNS: the same wrapping on every machine, and on the page


class _Parsed(BaseException):  # not an Exception: a tool's `except Exception` must not swallow it
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def captured_parser(main: Callable[[list[str]], Any], argv: list[str]) -> argparse.ArgumentParser:
    """The parser `main(argv)` parses its arguments with, stopped at `parse_args`."""

    def stop(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        raise _Parsed(self)

    with (
        mock.patch.object(argparse.ArgumentParser, "parse_args", stop),
        mock.patch.object(argparse.ArgumentParser, "parse_known_args", stop),
    ):
        try:
            main(argv)
        except _Parsed as parsed:
            return parsed.parser
    raise RuntimeError(f"{main.__module__}.main({argv}) returned without parsing its arguments")


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {name: p for a in subs for name, p in a.choices.items()}


def _summaries(parser: argparse.ArgumentParser) -> dict[str, str]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {c.dest: c.help or "" for a in subs for c in a._choices_actions}


def _shape(parser: argparse.ArgumentParser) -> tuple:
    return tuple(sorted((a.dest, *a.option_strings) for a in parser._actions))


def _modes(main: Callable[[list[str]], Any], parser: argparse.ArgumentParser) -> Iterator[tuple[str, Any]]:
    """A tool's flags that hand the arguments to a parser of another shape (`plan --memory`)."""
    for action in parser._actions:
        if isinstance(action, argparse._StoreTrueAction) and action.option_strings:
            flag = next((s for s in action.option_strings if s.startswith("--")), action.option_strings[0])
            mode = captured_parser(main, [flag])
            if _shape(mode) != _shape(parser):
                yield flag, mode


def _section(level: int, title: str, summary: str, parser: argparse.ArgumentParser) -> list[str]:
    lines = [f"{'#' * level} `{title}`", ""]
    if summary:
        lines += [summary[0].upper() + summary[1:] + ".", ""]
    lines += ["```text", parser.format_help().rstrip(), "```", ""]
    for name, sub in _subcommands(parser).items():
        lines += _section(level + 1, f"{title} {name}", _summaries(parser).get(name, ""), sub)
    return lines


def render() -> str:
    """Every command's section, in the order `ddpkit --help` lists them."""
    import os

    os.environ["COLUMNS"] = HELP_WIDTH
    from ddpkit import cli

    top = cli.build_parser()
    lines = ["```text", top.format_help().rstrip(), "```", ""]
    summaries = _summaries(top)
    for name, sub in _subcommands(top).items():
        if name in cli.TOOLS:
            main = importlib.import_module(cli.TOOLS[name][0]).main
            parser = captured_parser(main, [])
            parser.prog = f"ddpkit {name}"
            lines += _section(2, f"ddpkit {name}", summaries.get(name, ""), parser)
            for flag, mode in _modes(main, parser):
                mode.prog = f"ddpkit {name} {flag}"
                lines += _section(3, f"ddpkit {name} {flag}", "", mode)
        else:
            lines += _section(2, f"ddpkit {name}", summaries.get(name, ""), sub)
    return "\n".join(lines)


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    """MkDocs' hook: the marked line becomes the reference."""
    return markdown.replace(MARK, render()) if MARK in markdown else markdown


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    print(render())
