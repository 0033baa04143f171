"""``mutualrl compare``: every strategy x seed on one config, then a report side by side.

Each seed is a paired experiment: the config's ``seed`` is replaced by the seed index, and the loop
derives prompts and initial weights from it, so ``none-seed0`` and ``sgt-seed0`` start from the same
weights and see the same prompts. Only the sharing differs. The warm start goes through a cache in
``<report>/warmstart/`` (``warmup.cache_dir``): the first run of a seed warms up and stores its
policies, the seed's other runs load them, so they start from identical weights by construction
and the warm start is paid once per seed.

Runs go into ``<report>/runs/<strategy>-seed<s>/``, one after another, or ``jobs`` at a time in
worker processes (``--jobs``): a seed's first run goes first and its other runs start once it has
stored the warm start, so every run computes exactly what it would sequentially. The compare's
own state (``compare.json``: what was asked, the commit, each run's status) is rewritten after every
change,
so ``--resume`` continues an interrupted compare: a run is finished when its ``summary.json``
exists; anything else is cleared and redone. The report is built only from what runs wrote
(``mutualrl.report``), so ``--report-only`` can rebuild it at any time.
"""

from __future__ import annotations

import argparse
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mutualrl.compare.parallel import run_parallel
from mutualrl.compare.progress import CompareProgress, _NestedRunProgress
from mutualrl.compare.state import (
    _new_state,
    open_state,
    read_state,
    write_state,
)
from mutualrl.compare.tuning import (
    Arm,
    add_tuning_arguments,
    parse_tune,
    plain_arms,
    tuned_arms,
    tuning_arms,
    tuning_lines,
    write_tuning,
)
from mutualrl.config import ConfigError
from mutualrl.report.analysis import starting_point_line
from mutualrl.run.folder import claim
from mutualrl.storage import remove_tree, strictly_inside

WARMSTART_DIR = "warmstart"
DEFAULT_CONFIG = "default"  # the packaged config (config.packaged): any folder
# What `--scenario` adds to every run (before --set/--steps, which win): a schedule meant to fit
# one scenario of the embedded default at 3 seeds with every registered strategy in about 20
# minutes on 2 CPU cores with --jobs 2 (docs/concepts/scenarios.md says what was measured).
# Evaluations at
# steps 0, 10, 20, 30 give the held-out curve its area. One torch thread per run: hidden size 64
# gains little from more, and the results then do not depend on --jobs.
SCENARIO_BUDGET = (
    "steps=30",
    "eval.every=10",
    "eval.num_prompts=32",
    "eval.k=4",
    "torch_threads=1",
)


# ---- command line -----------------------------------------------------------------------------
def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        help="TOML run config file, or a packaged config's "
        "name (mutualrl configs list); required unless --report-only",
    )
    parser.add_argument(
        "--strategies",
        default=None,
        help="comma-separated strategies to compare, or 'all' (default: all "
        f"registered: {_known_names()})",
    )
    parser.add_argument(
        "--scenario",
        default=None,
        help=f"starting point of the policies ({', '.join(_scenario_names())}); "
        "sets `scenario` and the compare's time budget "
        f"({' '.join(SCENARIO_BUDGET)}); --config defaults to the packaged "
        f"{DEFAULT_CONFIG!r}",
    )
    parser.add_argument(
        "--seeds",
        type=int,
        default=3,
        help="number of seeds; seed s (0..N-1) replaces the config's seed (default 3)",
    )
    parser.add_argument(
        "--first-seed",
        type=int,
        default=0,
        help="the first seed: the compare runs seeds K..K+N-1 (default 0), so a comparison "
        "can be finished in parts, e.g. --seeds 2 --first-seed 1 after seed 0 ran elsewhere",
    )
    parser.add_argument(
        "--output-dir", help="report directory (default reports/compare-<config name>)"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="dotted override applied to every run, e.g. --set grpo.beta=0.01",
    )
    parser.add_argument("--steps", type=int, help="GRPO steps per run (overrides steps)")
    add_tuning_arguments(parser)
    _add_running_arguments(parser)


def _add_running_arguments(parser: argparse.ArgumentParser) -> None:
    """How the compare runs: resumed, its report rebuilt, runs at a time, progress."""
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue an interrupted compare in --output-dir; finished runs are kept",
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="rebuild the report from the runs already in --output-dir; run nothing",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs at a time, in worker processes (default 1); a run of the "
        "embedded default keeps about one core busy",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress display")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console(stderr=True)
    overrides = list(args.set) + ([f"steps={args.steps}"] if args.steps is not None else [])
    if args.scenario is not None:
        overrides = scenario_overrides(args.scenario) + overrides
        args.config = args.config or DEFAULT_CONFIG
    if not args.config and not (args.report_only and args.output_dir):
        raise ConfigError("compare: --config is required (or --report-only with --output-dir)")
    stem = Path(args.config).stem if args.config else ""
    out = Path(
        args.output_dir
        or f"reports/compare-{stem}" + (f"-{args.scenario}" if args.scenario else "")
    )
    if args.report_only:
        from mutualrl.report import write_report

        path = write_report(out, read_state(out))
        console.print(f"report: {path}")
        return 0
    strategies = parse_strategies(args.strategies)
    if args.tune and args.tuned:
        raise ConfigError("compare: --tune chooses settings and --tuned uses them: give one")
    arms = (
        tuning_arms(strategies, parse_tune(args.tune))
        if args.tune
        else tuned_arms(strategies, Path(args.tuned))
        if args.tuned
        else None
    )
    # SIGTERM takes the path of Ctrl-C: the runs are marked interrupted, the workers are passed
    # SIGTERM and stop at a step boundary (a run in this process installs its own handler).
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        with CompareProgress(
            enabled=not args.no_progress, console=console, jobs=args.jobs
        ) as progress:
            report = compare(
                args.config,
                strategies,
                args.seeds,
                out,
                overrides=overrides,
                resume=args.resume,
                progress=progress,
                jobs=args.jobs,
                arms=arms,
                first_seed=args.first_seed,
            )
    finally:
        signal.signal(signal.SIGTERM, previous)
    tuning = write_tuning(out, read_state(out))
    for line in tuning_lines(tuning) if tuning else ():
        console.print(f"tuned on validation: {line}", highlight=False)
    console.print(f"[bold]report[/]: {report}")
    return 0


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")


def _known_names() -> str:
    from mutualrl.strategies import STRATEGIES

    return ", ".join(STRATEGIES.names())


def _scenario_names() -> list[str]:
    from mutualrl.run.scenarios import SCENARIOS

    return SCENARIOS.names()


def scenario_overrides(name: str) -> list[str]:
    """``--scenario NAME``: the scenario and the compare's time budget, as overrides."""
    if name not in _scenario_names():
        raise ConfigError(f"--scenario: unknown {name!r}; known: {', '.join(_scenario_names())}")
    return [f"scenario={_toml_str(name)}", *SCENARIO_BUDGET]


def parse_strategies(text: str | None) -> list[str]:
    """``"none, sgt,none"`` -> ``["none", "sgt"]``; ``None`` or ``"all"`` -> every registered
    strategy."""
    from mutualrl.strategies import STRATEGIES

    if text is None or text.strip() == "all":
        return list(STRATEGIES.names())
    names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if not names:
        raise ConfigError(f"--strategies: no strategy named; known: {_known_names()}")
    return names


# ---- planning ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlannedRun:
    strategy: str
    seed: int
    cfg: Any  # RunConfig with seed, strategy and output_dir set

    @property
    def name(self) -> str:
        return run_name(self.strategy, self.seed)


def run_name(strategy: str, seed: int) -> str:
    return f"{strategy}-seed{seed}"


def _toml_str(text: str) -> str:
    # Escaped whole (quote, backslash, every control character): a folder or name holding any
    # of them reaches the config unchanged. (JSON's escaping writes a folder name's undecodable
    # byte, Python's surrogate escape, as \udcXX, which TOML refuses.)
    from mutualrl.config.load import toml_string

    return toml_string(text)


def plan_runs(
    config_path: str | Path,
    strategies: Sequence[str],
    seeds: int,
    out: Path,
    overrides: Sequence[str],
    arms: Sequence[Arm] | None = None,
    first_seed: int = 0,
) -> list[PlannedRun]:
    """Load and validate every run's config and strategy parameters before anything runs.

    Seed-major order, so an interrupted compare has whole seeds (every strategy) done first.
    ``arms``: the compare's columns when they are not plain strategies (``compare.tuning``):
    each run is named by its arm's label and gets the arm's overrides after the compare's.
    ``first_seed``: the seeds are ``first_seed .. first_seed + seeds - 1``.
    """
    from mutualrl.config import load_config
    from mutualrl.run.inputs import check_inputs
    from mutualrl.run.scenarios import check_scenario
    from mutualrl.strategies import STRATEGIES, build_strategy

    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise ConfigError(
            f"--strategies: unknown {', '.join(map(repr, unknown))}; known: {_known_names()}"
        )
    if seeds < 1:
        raise ConfigError(f"--seeds must be >= 1, got {seeds}")
    if first_seed < 0:
        raise ConfigError(f"--first-seed must be >= 0, got {first_seed}")
    # One warm-start cache per compare (unless the config names one): the runs of a seed then
    # start from the very same warm-started policies, and the warm start is paid once per seed.
    if load_config(config_path, overrides).warmup.cache_dir is None:
        overrides = [*overrides, f"warmup.cache_dir={_toml_str(str(out / WARMSTART_DIR))}"]
    runs = []
    for seed in range(first_seed, first_seed + seeds):
        for arm in arms or plain_arms(strategies):
            strategy = arm.label
            run_dir = out / "runs" / run_name(strategy, seed)
            if run_dir.parent != out / "runs" or not strictly_inside(run_dir, out / "runs"):
                raise ConfigError(
                    f"--strategies: {strategy!r} cannot name a run folder (a "
                    f"strategy's name becomes {run_dir.name!r} in {out / 'runs'})"
                )
            cfg = load_config(
                config_path,
                [
                    *overrides,
                    *arm.overrides,
                    f"seed={seed}",
                    f"strategy={_toml_str(arm.strategy)}",
                    f"output_dir={_toml_str(str(run_dir))}",
                ],
            )
            if seed == first_seed:
                build_strategy(cfg)  # bad [strategies.<name>] parameters fail here, first
                check_scenario(cfg)  # and a scenario that cannot plan the warm start
                check_inputs(cfg)  # registry names, the device, backend packages
            runs.append(PlannedRun(strategy, seed, cfg))
    return runs


# ---- the compare ------------------------------------------------------------------------------
@dataclass
class _Runner:
    out: Path
    state: dict[str, Any]
    progress: CompareProgress
    train_fn: Callable
    redone: list[str] = field(default_factory=list)
    seeds_shown: set[int] = field(default_factory=set)

    def finished(self, r: PlannedRun) -> bool:
        return (self.out / "runs" / r.name / "summary.json").exists()

    def set_status(self, r: PlannedRun, **fields) -> None:
        self.state["runs"].setdefault(r.name, {"strategy": r.strategy, "seed": r.seed}).update(
            fields
        )
        write_state(self.out, self.state)

    def begin(self, r: PlannedRun) -> bool:
        """Clear or keep the run's directory and mark it running; True: it resumes a checkpoint."""
        from mutualrl.run.checkpoint import latest

        run_dir = self.out / "runs" / r.name
        # An unfinished run continues from its last complete checkpoint; without one it is redone
        # from scratch (its partial metrics would otherwise mix with the redo).
        resume = run_dir.exists() and latest(run_dir, report=self.progress.note) is not None
        if run_dir.exists() and not resume:  # never anything outside the compare's runs/
            remove_tree(run_dir, within=self.out / "runs")
        self.set_status(r, status="running", commit=self.state["commit"], error=None)
        return resume

    def failed(self, r: PlannedRun, exc: BaseException) -> None:
        from mutualrl.run.signals import RunInterrupted

        status = "interrupted" if isinstance(exc, (KeyboardInterrupt, RunInterrupted)) else "failed"
        self.set_status(r, status=status, error=f"{type(exc).__name__}: {exc}")

    def execute(self, r: PlannedRun) -> None:
        resume = self.begin(r)
        rp = self.progress.run_started(r.name)
        try:
            summary = self.train_fn(r.cfg, rp, resume=True) if resume else self.train_fn(r.cfg, rp)
        except BaseException as exc:
            self.failed(r, exc)
            raise
        finally:
            if isinstance(rp, _NestedRunProgress):
                rp.close()
        self.done(r, summary)

    def done(self, r: PlannedRun, summary) -> None:
        self.set_status(r, status="done", wall_time_s=summary.wall_time_s)
        self.redone.append(r.name)
        evals = ", ".join(
            f"{n} pass@1 {summary.final_eval.get(f'policy/{n}/heldout/pass@1', float('nan')):.2f}"
            for n in summary.reward_first
        )
        start = (
            starting_point_line(self.out / "runs" / r.name)
            if r.seed not in self.seeds_shown
            else ""
        )
        if start:  # the seed's starting point, once: every run of a seed shares its warm start
            self.seeds_shown.add(r.seed)
            start = f"\n    starting point, seed {r.seed} (family greedy/sampled): {start}"
        self.progress.run_finished(
            r.name, f"  {r.name}: {summary.wall_time_s:.0f}s; {evals}", summary.wall_time_s, start
        )


def compare(
    config_path: str | Path,
    strategies: Sequence[str],
    seeds: int,
    output_dir: str | Path,
    *,
    overrides: Sequence[str] = (),
    resume: bool = False,
    progress: CompareProgress | None = None,
    train_fn: Callable | None = None,
    jobs: int = 1,
    arms: Sequence[Arm] | None = None,
    first_seed: int = 0,
) -> Path:
    """Run every strategy x seed (skipping finished ones on ``resume``) and write the report.

    Returns the path of ``report.md``. Everything is validated before the first run starts.
    ``train_fn(cfg, progress) -> RunSummary`` defaults to ``mutualrl.run.train`` (with
    ``jobs`` > 1 it must be picklable: a module-level function). ``jobs``: runs at a time, in
    worker processes. ``arms``: columns other than the plain strategies (``compare.tuning``).
    ``first_seed``: run seeds ``first_seed .. first_seed + seeds - 1``.
    """
    from mutualrl.report import write_report

    if jobs < 1:
        raise ConfigError(f"--jobs must be >= 1, got {jobs}")
    out = Path(output_dir)
    runs = plan_runs(config_path, strategies, seeds, out, overrides, arms, first_seed)
    runs = _with_packaged_models(runs)  # converted once, here, before any run's process
    with claim(out, what="compare"):  # one compare writes a folder at a time
        state = _run_all(
            out,
            runs,
            open_state(
                out,
                _new_state(config_path, strategies, seeds, overrides, runs, arms, first_seed),
                resume,
            ),
            progress,
            train_fn,
            jobs,
        )
    return write_report(out, state)


def _with_packaged_models(runs: list[PlannedRun]) -> list[PlannedRun]:
    """The runs with packaged checkpoint names as their converted folders (policies.model_cache)."""
    import dataclasses

    import msgspec

    from mutualrl.policies.model_cache import LineStages, resolve_policies

    stages, memo = LineStages(), dict[str | None, str | None]()
    return [
        dataclasses.replace(
            r,
            cfg=msgspec.structs.replace(
                r.cfg, policies=resolve_policies(r.cfg.policies, stages, memo)
            ),
        )
        for r in runs
    ]


def _run_all(
    out: Path, runs: list[PlannedRun], state: dict[str, Any], progress, train_fn, jobs: int
) -> dict[str, Any]:
    """Every run not finished yet, one at a time or ``jobs`` at a time; the final state."""
    out.mkdir(parents=True, exist_ok=True)
    write_state(out, state)
    if train_fn is None:
        from mutualrl.run import train as train_fn
    runner = _Runner(out, state, progress or CompareProgress(enabled=False), train_fn)
    todo = [r for r in runs if not runner.finished(r)]
    for r in runs:
        if runner.finished(r):  # an interruption after its summary was written is no error
            state["runs"][r.name].update(status="done", error=None)
    write_state(out, state)
    runner.progress.start(len(runs), len(runs) - len(todo))
    if jobs > 1 and len(todo) > 1:
        run_parallel(runner, todo, jobs)
    else:
        for r in todo:
            runner.execute(r)
    return state
