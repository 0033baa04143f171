"""``mutualrl bench retokenize``: run the retokenization benchmark, print a table, write JSON.

The main CLI wires this module as a subcommand through ``configure(parser)`` and ``run(args)``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

from mutualrl.bench.results import write_run
from mutualrl.bench.retokenize import DEFAULT_PAIRS, run_benchmark
from mutualrl.provenance import git_commit, machine_info
from mutualrl.retokenize.encoding import rust_threads
from mutualrl.retokenize.loaders import TokenizerHandle, load_tokenizer

_ROWS = (
    "encode",
    "encode_batch",
    "encode_batch_fast",
    "align",
    "align_per_text",
    "end_to_end",
    "end_to_end_batch",
    "e2e_target",
    "e2e_source",
    "align_trl",
    "align_spacy",
    "align_naive",
)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--corpus",
        default=None,
        help="folder of *.jsonl files with a 'completion' field (default: benchmarks/corpus)",
    )
    parser.add_argument(
        "--pairs",
        default=None,
        help="comma-separated SOURCE:TARGET tokenizer pairs: packaged tokenizers, tokenizer "
        "files or folders, or packaged models (smollm2-135m-instruct: its converted folder's "
        "tokenizer) (default: both directions of deepseek-v3, mistral-v1, bert-wordpiece)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed passes per measurement")
    parser.add_argument(
        "--naive-texts",
        type=int,
        default=8,
        help="texts given to the quadratic decode-prefix baseline (0: skip it)",
    )
    parser.add_argument("--no-peers", action="store_true", help="skip TRL/spacy/naive peers")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="threads for both sides alike: the Rust tokenizers' pool that the "
        "receiver's encode_batch and every Rust call of the retokenizer use "
        "(RAYON_NUM_THREADS; 1 also sets TOKENIZERS_PARALLELISM=false) "
        "(default: the environment's, else one per core)",
    )
    parser.add_argument(
        "--output",
        default="bench-results/retokenize.json",
        help="where to write the JSON results; into a file of several runs ({'runs': [...]}, "
        "as benchmarks/results/retokenize.json), in place of the run of the same --pairs",
    )


def _parse_pairs(text: str | None) -> tuple[tuple[str, str], ...]:
    if not text:
        return DEFAULT_PAIRS
    pairs = []
    for item in text.split(","):
        src, sep, tgt = item.strip().partition(":")
        if not sep or not src or not tgt:
            raise ValueError(
                f"--pairs: expected SOURCE:TARGET items separated by commas, got {item!r}"
            )
        pairs.append((src, tgt))
    return tuple(pairs)


def _machine() -> dict:
    """Where the numbers were taken (no torch import: the benchmark does not need it)."""
    import importlib.metadata

    import numpy
    import tokenizers

    try:
        numba = importlib.metadata.version("numba")
    except importlib.metadata.PackageNotFoundError:
        numba = None
    return machine_info(
        numpy=numpy.__version__,
        tokenizers=tokenizers.__version__,
        numba=numba,
    )


def _print_table(results: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    for pair in results["pairs"]:
        table = Table(
            title=f"{pair['source']} -> {pair['target']}  "
            f"({pair['target_tokens']} target tokens, {pair['bytes']} bytes)"
        )
        for col in ("measurement", "median ms", "spread ms (min-max)", "target tok/s", "note"):
            table.add_column(col, justify="left" if col in ("measurement", "note") else "right")
        for name in _ROWS:
            t = pair["timings"].get(name)
            if t is not None:
                table.add_row(
                    name,
                    f"{t['median_s'] * 1e3:.2f}",
                    f"{t['min_s'] * 1e3:.2f}-{t['max_s'] * 1e3:.2f}",
                    f"{t['tokens_per_s']:,.0f}",
                    t["note"],
                )
        console.print(table)
        console.print("  ratios: " + ", ".join(f"{k}={v:.2f}" for k, v in pair["ratios"].items()))
        console.print(
            "  end_to_end_batch / encode_batch in parts: "
            + ", ".join(
                f"{k}={v:.2f}" for k, v in pair["end_to_end_batch_parts_over_encode_batch"].items()
            )
        )
        console.print(
            "  paired (alternating calls), median (min-max): "
            + ", ".join(
                f"{k}={v['median']:.2f} ({v['min']:.2f}-{v['max']:.2f})"
                for k, v in pair["paired"].items()
            )
        )
        console.print(
            "  residuals: " + ", ".join(f"{k}={v:.3g}" for k, v in pair["residuals"].items())
        )


def set_threads(threads: int | None) -> dict:
    """Give the Rust tokenizers' thread pool ``threads`` threads (before its first parallel call,
    which builds it) and return what both sides of every ratio ran with."""
    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads: expected an integer >= 1, got {threads}")
        os.environ["RAYON_NUM_THREADS"] = str(threads)
        os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads > 1 else "false"
    # Both sides of every ratio use that pool for their Rust calls and one Python thread besides
    # (a helper thread for the receiver's encode beside the sender's side was tried: slower, as
    # the pool already keeps every core busy).
    return {
        "requested": threads,
        "cpu_count": os.cpu_count(),
        "tokenizers_pool": rust_threads(),
        **{k: os.environ.get(k) for k in ("RAYON_NUM_THREADS", "TOKENIZERS_PARALLELISM")},
        "python_threads": 1,
    }


def _model_tokenizers(pairs: tuple[tuple[str, str], ...]) -> dict[str, TokenizerHandle]:
    """The tokenizers of the packaged models a pair names, from their converted folders (built
    once, as `mutualrl train` builds them), kept under the model's name in the results."""
    from mutualrl.policies.model_cache import resolve_checkpoint
    from mutualrl.policies.packaged import is_packaged_name

    names = {n for pair in pairs for n in pair if is_packaged_name(n)}
    return {
        name: dataclasses.replace(load_tokenizer(str(resolve_checkpoint(name))), name=name)
        for name in sorted(names)
    }


def run(args: argparse.Namespace) -> int:
    try:
        pairs = _parse_pairs(args.pairs)
        threads = set_threads(args.threads)
        handles = _model_tokenizers(pairs)
    except ValueError as exc:  # PackagedModelError included: a model not installed
        print(f"error: {exc}", file=sys.stderr)
        return 2
    results = run_benchmark(
        pairs,
        handles=handles,
        corpus=args.corpus,
        repeats=args.repeats,
        naive_texts=0 if args.no_peers else args.naive_texts,
        peers=not args.no_peers,
    )
    results = {
        "benchmark": "retokenize",
        "label": args.pairs or "default",
        "machine": _machine(),
        "git_commit": git_commit(),
        "threads": threads,
        **results,
    }
    _print_table(results)
    out = Path(args.output)
    write_run(out, results)  # into a file of several runs, in place of this --pairs' run
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry: ``python -m mutualrl.bench.retokenize_cli``."""
    parser = argparse.ArgumentParser(prog="mutualrl bench retokenize", description=__doc__)
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
