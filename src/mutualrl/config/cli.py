"""``mutualrl configs list`` and ``mutualrl configs show NAME``: the example configs it ships.

``show`` prints a config's TOML as it is, comments included, so a copy to edit is
``mutualrl configs show tiny > my-run.toml``; ``--config NAME`` runs one unchanged.
"""

from __future__ import annotations

import argparse
import sys

from mutualrl.config.packaged import packaged_config, packaged_names


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="configs_command", required=True)
    sub.add_parser(
        "list",
        help="the packaged configs and what each is for",
        description="List the example configs mutualrl ships (use one with --config NAME).",
    )
    show = sub.add_parser(
        "show",
        help="print a packaged config (redirect it to a file to edit)",
        description="Print a packaged config's TOML, e.g. mutualrl configs show tiny > my-run.toml",
    )
    show.add_argument("name", metavar="NAME", help="packaged config name (see `configs list`)")


def run(args: argparse.Namespace) -> int:
    if args.configs_command == "show":
        sys.stdout.write(packaged_config(args.name).read_text(encoding="utf-8"))
        return 0
    names = packaged_names()
    width = max(map(len, names), default=0)
    for name in names:
        print(f"{name:<{width}}  {_summary(name)}".rstrip())
    return 0


def _summary(name: str, width: int = 100) -> str:
    """The first sentence of the config's opening comment (each says what it is for), cut to
    ``width`` characters."""
    lines = []
    for line in packaged_config(name).read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    sentence = " ".join(lines).split(". ")[0].rstrip(".")
    return sentence if len(sentence) <= width else sentence[: width - 3].rsplit(" ", 1)[0] + "..."
