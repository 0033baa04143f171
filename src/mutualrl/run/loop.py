"""The whole job: build, warm start, the GRPO steps, evaluation, checkpoints, saving.

One GRPO step, top to bottom (``run.phases``), scheduled lock-step or paced by
``run.schedule``:

    sample prompts -> each policy generates -> verify -> publish experience
    -> the strategy routes and adapts peer experience -> each policy updates -> log
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import msgspec
import numpy as np

from mutualrl.config import RunConfig
from mutualrl.policies.model_cache import resolve_policies
from mutualrl.policies.precision import resolve_precision
from mutualrl.policies.worker import SavePretrained
from mutualrl.run import checkpoint
from mutualrl.run.build import build_run, prepare
from mutualrl.run.evaluation import evaluate
from mutualrl.run.folder import claim
from mutualrl.run.guards import GuardTripped
from mutualrl.run.metrics import read_metrics
from mutualrl.run.paced import pace_summary
from mutualrl.run.progress import RunProgress
from mutualrl.run.restarts import Restarts, checkpoint_at_start
from mutualrl.run.resume import open_checkpoint, resume_from
from mutualrl.run.schedule import train_loop
from mutualrl.run.signals import RunInterrupted, StopRequests
from mutualrl.run.state import Run
from mutualrl.run.warmup import warm_start
from mutualrl.workers.calls import WorkerFailedError


def save_checkpoint(run: Run, step: int) -> None:
    """Every ``save_steps`` steps: a complete, atomic checkpoint (``run.checkpoint``)."""
    if run.cfg.save_steps and step % run.cfg.save_steps == 0:
        with run.timed("save"):
            checkpoint.save(run, step)


def stop_here(run: Run, step: int) -> None:
    """A signal asked the run to stop: checkpoint the steps done (if checkpoints are on and this
    step has none yet) and raise ``RunInterrupted`` with the command that continues it."""
    ckpt = None
    every = run.cfg.save_steps
    if every:
        if step % every:
            with run.timed("save"):
                ckpt = checkpoint.save(run, step)
        else:
            ckpt = run.out / checkpoint.CHECKPOINT_DIR / f"{checkpoint.PREFIX}{step:06d}"
    run.progress.finish_phase(f"stopped after step {step}")
    signum = run.stop.signum
    assert signum is not None, "the run stops here only when a signal asked it to"
    raise RunInterrupted(signum, step, run.out, ckpt)


@dataclass(frozen=True)
class RunSummary:
    output_dir: str
    # Per policy, the mean train reward over the first and over the last quarter of the GRPO
    # steps (one step each at least): single steps of a few prompts are noisy.
    reward_first: dict[str, float]
    reward_last: dict[str, float]
    final_eval: dict[str, float]
    wall_time_s: float
    # Wall seconds by phase: build, warm start, train (GRPO steps), eval, save.
    phase_times_s: dict[str, float] = field(default_factory=dict)
    # Per policy: steps, wall and busy seconds, idle fraction, steps a minute; paced runs also
    # the gate wait, the age of the peer experience used and what was dropped as stale (busy
    # seconds and idle fraction None where the rows have no busy time: ``run.paced.pace_summary``).
    pace: dict[str, dict[str, float | None]] = field(default_factory=dict)
    # A paced run's books of peer experience (``run.paced.Pace.books``); empty for lock-step.
    pace_books: dict = field(default_factory=dict)
    # Policies that left under on_failure = "continue": step, phase, call, error
    # (``run.departures``; tracebacks in failures.jsonl).
    failed: dict[str, dict] = field(default_factory=dict)
    # Restarts per policy under on_failure = "restart" (``run.restarts``; failures.jsonl).
    restarts: dict[str, int] = field(default_factory=dict)
    # Per receiver, its retokenizer's encoding-cache lookups and hits in this process (since the
    # run started, or since it resumed: the cache is not checkpointed). Whether the cache pays.
    retokenize_cache: dict[str, dict[str, int]] = field(default_factory=dict)


def summarize(run: Run, final_eval: dict, wall: float) -> RunSummary:
    # First and last quarter of the steps: a few prompts per step make single steps noisy.
    window = max(1, len(next(iter(run.history.values()), [])) // 4)
    first = {n: float(np.mean(h[:window])) for n, h in run.history.items()}
    last = {n: float(np.mean(h[-window:])) for n, h in run.history.items()}
    summary = RunSummary(
        str(run.out),
        first,
        last,
        {k: v for k, v in final_eval.items() if k not in ("phase", "step")},
        wall,
        dict(run.phase_times),
        pace_summary(read_metrics(run.out / "metrics.jsonl"), list(run.policies)),
        run.pace.books() if run.pace is not None else {},
        run.departures.summary(),
        dict(run.restarts),
        {
            n: {"lookups": rt.cache.hits + rt.cache.misses, "hits": rt.cache.hits}
            for n, rt in run.retokenizers.items()
        },
    )
    (run.out / "summary.json").write_bytes(
        msgspec.json.format(msgspec.json.encode(summary), indent=2)
    )
    return summary


def save_policies(run: Run) -> None:
    with run.timed("save"):
        run.call_live(SavePretrained(str(run.out / "policies")))


def train(
    cfg: RunConfig,
    progress: RunProgress | None = None,
    resume: bool = False,
    overwrite: bool = False,
) -> RunSummary:
    """Run the whole job: build, warm start, train, evaluate, save. Metrics are kept on failure.

    ``resume``: continue ``cfg.output_dir`` from its last complete checkpoint instead (no warm
    start; the config may differ only in harmless fields, see ``run.resume``). A fresh run
    into a folder holding a run is refused unless ``overwrite`` (``run.folder``). The process
    holds the folder's lock from before its first write to the end; SIGINT and SIGTERM stop the
    run at a step boundary (``run.signals``). Under ``allocation.on_failure = "restart"`` a
    failed worker takes the run back to its last checkpoint, every worker rebuilt
    (``run.restarts``)."""
    t0 = time.perf_counter()
    # Packaged model names become their converted folders here, once, before any worker starts.
    cfg = msgspec.structs.replace(cfg, policies=resolve_policies(cfg.policies, progress))
    cfg = resolve_precision(cfg)  # dtype = "auto" becomes what this machine computes in
    prepared = prepare(cfg)
    with claim(cfg.output_dir, resume=resume, overwrite=overwrite), StopRequests() as stop:
        opened = open_checkpoint(cfg) if resume else None
        restarts, built = Restarts(cfg), t0
        while True:
            run = build_run(
                cfg,
                progress,
                prepared,  # policies that left stay gone
                departed=opened[0].state.get("departures") if opened else None,
            )
            run.stop, run.restarts = stop, restarts.counts
            run.phase_times["build"] += time.perf_counter() - built
            try:
                return _train_built(run, opened, t0)
            except WorkerFailedError as exc:  # the attempt is closed; under "restart", go back
                found = restarts.take(exc)  # to the last checkpoint (run.restarts), else raise
            built = time.perf_counter()
            prepared = prepare(cfg)
            ckpt, record = open_checkpoint(cfg, found)
            opened = ckpt, restarts.record(record)


def _train_built(run: Run, opened, t0: float) -> RunSummary:
    cfg = run.cfg
    try:
        if opened is None:
            with run.timed("warm start"):
                warm_start(run)
            evaluate(run, 0)  # the starting point every later evaluation is compared with
            run.departures.check(run, 0, "warm start")
            start = 0
            if checkpoint_at_start(cfg):  # something for a restart to go back to
                with run.timed("save"):
                    checkpoint.save(run, 0)
        else:
            start = resume_from(run, *opened)
        try:
            train_loop(run, start, save_checkpoint, stop_here)
        except GuardTripped as exc:  # its record is written; checkpoint what was trained, stop
            checkpoint.save(run, exc.step + 1)
            save_policies(run)
            raise
        final = evaluate(run, cfg.steps)
        run.departures.check(run, cfg.steps, "eval")
        save_policies(run)
        summary = summarize(run, final, time.perf_counter() - t0)
    except BaseException:
        # the error in flight is the one to report; closing after it (a full disk, a dead
        # worker) may fail too
        with contextlib.suppress(Exception):
            run.close()
        raise
    run.close()
    return summary
