"""MkDocs hook: the command-line reference, generated from the argument parsers at build time.

``mutualrl.cli.build_parser()`` assembles the parser of every subcommand (``train`` in ``cli.py``,
the others from the layers that implement them); this module walks it and writes
``reference/cli.md``: each command's description, usage and arguments with their defaults and
help text. Nothing is copied by hand, so a new option appears on the next build.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = "reference/cli.md"

# Document the tree being built, not whichever copy of mutualrl the environment installed.
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

HEADER = """# Command-line reference

`mutualrl` is installed as a console script with the package (`pip install -e .`). This page is
generated from the argument parsers when the site is built; `mutualrl <command> --help` prints
the same. Exit codes: 0 success, 1 a storage error (e.g. a full disk), 2 a usage or configuration
error, 3 a guard stopped the run (see [tracking and guards](../guides/tracking.md)), 130 / 143
interrupted by SIGINT / SIGTERM (the message says how to resume).
"""


def commands(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """``parser`` and, depth first, every subcommand's parser."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from commands(sub)


def _cell(text: str) -> str:
    return text.replace("|", r"\|").replace("<", "&lt;").replace(">", "&gt;").replace("\n", " ")


def _argument(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if action.option_strings:
        name = ", ".join(action.option_strings)
        if action.nargs != 0:
            metavar = action.metavar or action.dest.upper()
            name += f" {metavar}"
    else:
        name = action.metavar or action.dest
    help_text = parser._get_formatter()._expand_help(action) if action.help else ""
    if action.choices and not isinstance(action, argparse._SubParsersAction):
        help_text += f" (one of: {', '.join(map(str, action.choices))})"
    default = action.default
    shown = (
        ""
        if default in (None, False, [], argparse.SUPPRESS) or action.nargs == 0
        else f"`{default}`"
    )
    if isinstance(action, argparse._AppendAction):
        help_text += " (repeatable)" if "repeatable" not in help_text else ""
    return f"| `{_cell(name)}` | {shown} | {_cell(help_text)} |"


def render_command(parser: argparse.ArgumentParser) -> str:
    title = parser.prog
    lines = [f"## `{title}` {{ #{title.replace(' ', '-')} }}", ""]
    if parser.description:
        text = _cell(parser.description)
        lines += [text[:1].upper() + text[1:], ""]
    lines += ["```text", parser.format_usage().strip(), "```", ""]
    rows = [
        _argument(parser, a)
        for a in parser._actions
        if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
    ]
    if rows:
        lines += ["| argument | default | what it does |", "|---|---|---|", *rows, ""]
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for action in subs:
        lines += ["| command | what it does |", "|---|---|"]
        for choice in action._choices_actions:
            link = f"{parser.prog} {choice.dest}".replace(" ", "-")
            lines.append(f"| [`{choice.dest}`](#{link}) | {_cell(choice.help or '')} |")
        lines.append("")
    return "\n".join(lines)


def render() -> str:
    from mutualrl.cli import build_parser

    # argparse wraps usage lines at the terminal's width: fix it so every build writes the same
    # page.
    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"
    try:
        parts = [render_command(p) for p in commands(build_parser())]
    finally:
        if saved is None:
            os.environ.pop("COLUMNS")
        else:
            os.environ["COLUMNS"] = saved
    return "\n".join([HEADER, *parts])


def on_files(files, config):
    """MkDocs event: add the generated page to the site's files."""
    from mkdocs.structure.files import File

    files.append(File.generated(config, PAGE, content=render()))
    return files
