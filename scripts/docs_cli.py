"""The command-line reference, rendered from the parsers themselves: an MkDocs hook (mkdocs.yml `hooks:`).

A page that holds the line `<!-- cli-reference -->` gets, in its place, one section per `ddpkit` command:
its summary and its `--help`, for every subcommand (`ddpkit bench tune`) and every tool mode with a parser of
its own (`ddpkit plan --memory`), as `ddpkit.cli.commands` walks them: the tools build their parsers inside
their `main` (their modules import only when asked for), so a parser is taken at its `parse_args`, before
anything of the tool runs, and the page cannot drift from what `ddpkit X --help` prints.
`python scripts/docs_cli.py` prints the same Markdown.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

MARK = "<!-- cli-reference -->"
HELP_WIDTH = "100"  # argparse reads COLUMNS: the same wrapping on every machine, and on the page


def render() -> str:
    """Every command's section, in the order `ddpkit --help` lists them (`ddpkit.cli.commands`, the walk
    the option inventory reads too)."""
    os.environ["COLUMNS"] = HELP_WIDTH
    from ddpkit import cli

    lines = ["```text", cli.build_parser().format_help().rstrip(), "```", ""]
    for command in cli.commands():
        lines += [f"{'#' * (2 + command.depth)} `{command.where}`", ""]
        if command.summary:
            lines += [command.summary[0].upper() + command.summary[1:] + ".", ""]
        lines += ["```text", command.parser.format_help().rstrip(), "```", ""]
    return "\n".join(lines)


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    """MkDocs' hook: the marked line becomes the reference."""
    return markdown.replace(MARK, render()) if MARK in markdown else markdown


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    print(render())
