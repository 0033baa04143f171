"""``mutualrl exchange inspect RUN_DIR``: summarise (and optionally dump) an experience log.

The main CLI calls ``configure`` to add the arguments of the ``inspect`` subcommand and ``run``
to execute it. The log is read in skip mode unless ``--strict``, so damage is reported in the
summary instead of stopping the inspection. Exit status: 0 for a clean log, 1 when anything was
damaged, truncated, oversize or invalid (unknown kinds alone are normal: a newer writer), 2 when
the log cannot be read at all.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter

import msgspec
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from mutualrl.config import ConfigError
from mutualrl.exchange.errors import ExchangeError
from mutualrl.exchange.framing import ReadStats
from mutualrl.exchange.kinds import EXPERIENCE_TYPES
from mutualrl.exchange.log import log_segments, read_log


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the ``inspect`` arguments to ``parser``."""
    parser.add_argument("run_dir", help="run directory (or its experience/ dir, or one segment)")
    parser.add_argument(
        "--dump",
        action="store_true",
        help="print records as JSON lines on stdout (summary goes to stderr)",
    )
    parser.add_argument(
        "--kind",
        action="append",
        default=None,
        metavar="K",
        help="only dump records of this kind, a registered experience type (repeatable)",
    )
    parser.add_argument(
        "--strict",
        action="store_true",
        help="stop at the first damaged frame or invalid record instead of "
        "skipping and counting it",
    )


def run(args: argparse.Namespace) -> int:
    """Execute ``inspect``; returns the exit status."""
    _check_kinds(args.kind)
    console = Console(stderr=bool(args.dump))  # keep stdout clean for JSON lines
    stats = ReadStats()
    try:
        segments = log_segments(args.run_dir)
        _read(args, stats)
    except (FileNotFoundError, ExchangeError) as exc:
        console.print(f"[bold red]error:[/] {escape(str(exc))}", soft_wrap=True, highlight=False)
        return 2
    _print_summary(console, args.run_dir, len(segments), stats)
    problems = (
        stats.damaged_frames
        + stats.truncated_frames
        + stats.oversize_frames
        + stats.invalid_records
    )
    return 1 if problems else 0


def _check_kinds(kinds: list[str] | None) -> None:
    """Every ``--kind`` is a registered experience type: the reader skips kinds it does not know
    (a newer writer's), so any other name would dump nothing, silently."""
    unknown = [k for k in kinds or () if k not in EXPERIENCE_TYPES]
    if unknown:
        raise ConfigError(
            f"--kind {', '.join(map(repr, unknown))}: not a registered experience "
            f"type; known kinds: {', '.join(EXPERIENCE_TYPES.names())}"
        )


def _read(args: argparse.Namespace, stats: ReadStats) -> None:
    kinds = set(args.kind) if args.kind else None
    encoder = msgspec.json.Encoder()
    out = sys.stdout
    for d in read_log(args.run_dir, stats=stats, on_error="raise" if args.strict else "skip"):
        if args.dump and (kinds is None or d.kind in kinds):
            out.write(
                encoder.encode(
                    {
                        "kind": d.kind,
                        "producer": d.producer,
                        "producer_version": d.producer_version,
                        "seq": d.seq,
                        "record": d.record,
                    }
                ).decode()
                + "\n"
            )


def _print_summary(console: Console, run_dir: str, segments: int, stats: ReadStats) -> None:
    ratio = stats.bytes_raw / stats.bytes_on_disk if stats.bytes_on_disk else 0.0
    overview = Table(title=f"experience log: {run_dir}", show_header=False)
    for name, value in [
        ("segments", segments),
        ("frames", stats.frames),
        ("records", stats.records),
        ("bytes on disk", stats.bytes_on_disk),
        ("uncompressed bytes", stats.bytes_raw),
        ("compression ratio", f"{ratio:.2f}x"),
    ]:
        overview.add_row(name, str(value))
    console.print(overview)

    counts = Table(title="records by kind and producer")
    counts.add_column("kind")
    counts.add_column("producer")
    counts.add_column("records", justify="right")
    for (kind, producer), n in sorted(stats.by_kind_producer.items()):
        counts.add_row(kind, producer, str(n))
    console.print(counts)

    skipped = Table(title="skipped", show_header=False)
    for name, value in [
        ("damaged frames", stats.damaged_frames),
        ("truncated frames", stats.truncated_frames),
        ("oversize frames", stats.oversize_frames),
        ("skipped bytes", stats.skipped_bytes),
        ("invalid records", stats.invalid_records),
        ("unknown kinds", _fmt_counter(stats.unknown_kinds)),
    ]:
        skipped.add_row(name, str(value))
    console.print(skipped)
    for message in stats.errors:
        console.print(f"[yellow]skipped:[/] {escape(message)}", soft_wrap=True, highlight=False)


def _fmt_counter(counter: Counter[str]) -> str:
    return ", ".join(f"{k}={n}" for k, n in sorted(counter.items())) or "0"
