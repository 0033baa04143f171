"""The one scheduler: every GRPO step of a run, lock-step or paced, driven by ``pacing.run_paced``.

A step's phases are written once (``Stepper``): ``run.phases.produce`` (sample prompts,
generate, verify, publish), then ``learn`` (strategy, update), then the step's record. Who takes a
step together is the only difference between the two ways a run is scheduled:

* lock-step (``allocation.max_staleness = 0``): every live policy as one member of the gate
  (``LockStepper``), so their generation and update go to the executor as one batched call each,
  and the strategy sees every policy's samples of the step (``hacpo`` needs that:
  ``needs_lock_step``);
* paced (``max_staleness = k >= 1``): each policy a member of its own (``PolicyStepper``), at its
  own pace behind the version gate, with its own strategy object; what it publishes reaches the
  peers through the run's ``run.paced.Pace`` (the gate, the records between the policies, the
  books, the rows gathered from each policy's part).

``train_loop`` runs the members in segments up to the next step where every policy meets (an
evaluation, a checkpoint, the last step), and there evaluates, checkpoints, and stops when a
signal asked it to. A lock-step member's exceptions are the run's: ``run_paced`` raises them as
they were raised (``on_failure = "raise"``).
"""

from __future__ import annotations

import dataclasses
import time
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Callable
from typing import Any, cast

import numpy as np

from mutualrl.pacing import PacedRecord, StepWorker, VersionGate, run_paced
from mutualrl.run.evaluation import evaluate
from mutualrl.run.paced import Pace, verification_seconds
from mutualrl.run.phases import (
    Produced,
    check_guards,
    learn,
    log_pace,
    log_step,
    policy_metrics,
    produce,
)
from mutualrl.run.state import Run
from mutualrl.strategies import StrategyContext
from mutualrl.workers import WorkerFailedError, WorkerUnavailable

LOCK_STEP = "lock-step"  # the one member of a lock-step run's gate: every live policy
# Calls a paced step makes on workers (generate, the strategy's, update), each bounded by
# call_timeout_s: a step still running after this many of them is declared hung. Verification
# is bounded on its own (task.verifier_timeout_s per call) and set aside (verification_seconds).
# A lock-step step is not bounded as a whole: each of its calls is.
CALLS_PER_STEP = 3
UNBOUNDED_S = 1e9  # a lock-step step's bound (threading's waits take at most about 9.2e9 s)


@dataclasses.dataclass
class _Started:
    made: Produced  # the step's first half
    t0: float  # when the step started
    busy: dict[str, float]  # the workers' busy seconds then
    versions: dict[str, int]  # the run's record of the weight versions then
    extra: Any = None  # what a paced step keeps between its halves (``_PacedStart``)


class Stepper(ABC):
    """A ``pacing.PhasedWorker``: one step of a group of policies (``names``; None: every live
    one), ``produce`` then ``learn``. The subclasses say who the group is, where its peers'
    experience comes from and how its part of the step's record is written."""

    names: list[str] | None = None

    def __init__(self, run: Run) -> None:
        self.run = run
        self.current: _Started | None = None

    def produce(self, k: int) -> list:
        run = self.run
        t0 = time.perf_counter()
        run.step_phases.clear()
        busy, versions = run.executor.busy_seconds(), dict(run.versions)
        extra = self._before(k)
        made = produce(run, k, self.names)
        self.current = _Started(made, t0, busy, versions, extra)
        return self._published(k, made)

    def learn(self, k: int, incoming: list[PacedRecord]) -> None:
        run, cur = self.run, self.current
        assert cur is not None, "run_paced calls learn after the step's produce"
        ctx, stats = learn(run, cur.made, experience=self._experience(incoming))
        busy = {n: v - cur.busy.get(n, 0.0) for n, v in run.executor.busy_seconds().items()}
        log_pace(run, ctx, cur.made.samples, busy, cur.versions)
        self.current = None
        self._record(k, cur, ctx, stats, incoming)

    # ---- what the group says --------------------------------------------------------------
    def _before(self, k: int) -> Any:
        return None

    def _published(self, k: int, made: Produced) -> list:
        """The step's records for the gate's channel (published to the exchange already)."""
        return []

    def _experience(self, incoming: list[PacedRecord]) -> list | None:
        """The peer experience ``learn`` uses (None: what the run's subscription holds)."""
        return None

    @abstractmethod
    def _record(self, k: int, cur: _Started, ctx: StrategyContext, stats, incoming) -> None:
        """Write the group's part of step ``k``'s record (and its per-step checks)."""


class LockStepper(Stepper):
    """Every live policy's step together: the step's record written whole (and kept as
    ``record``), then the per-step checks (policies that left, the guards) and the progress
    line."""

    record: dict | None = None

    def _record(self, k: int, cur: _Started, ctx: StrategyContext, stats, incoming) -> None:
        run, made = self.run, cur.made
        # time_s minus the phases is prompt sampling and logging (a record cannot time its write)
        elapsed = time.perf_counter() - cur.t0
        record = self.record = log_step(run, k, made.samples, made.gen_time, stats, ctx, elapsed)
        run.departures.check(run, k + 1, "train")
        check_guards(run, record)
        run.progress.advance(
            " | ".join(f"{n} r={np.mean(h[-5:]):.2f}" for n, h in run.history.items())
        )


def lock_step(run: Run, step: int) -> dict:
    """One lock-step GRPO step of every live policy, in this thread (what the benchmarks time;
    ``train_loop`` runs the same ``LockStepper`` behind the gate); its logged record."""
    stepper = LockStepper(run)
    stepper.produce(step)
    stepper.learn(step, [])
    assert stepper.record is not None
    return stepper.record


@dataclasses.dataclass
class _PacedStart:
    own: list  # the step's own records as the exchange delivered them
    waited: float  # seconds it waited at the gate before the step
    lead: int  # steps ahead of the slowest live peer when it started


class PolicyStepper(Stepper):
    """One policy's steps in a paced run, on a view of the run with its own strategy, its own
    records' subscription and its own phase clock; its part of each step's row goes to the
    run's ``Pace.rows``."""

    def __init__(self, run: Run, name: str, pace: Pace) -> None:
        super().__init__(
            dataclasses.replace(
                run,
                strategy=pace.strategies[name],
                subscription=pace.own[name],
                step_phases=defaultdict(float),
            )
        )
        self.name, self.names, self.pace = name, [name], pace
        self.wait_seen = pace.gate.wait_s[name]
        self.dropped_seen = pace.dropped[name]

    def _before(self, k: int) -> _PacedStart:
        name, gate = self.name, self.pace.gate
        versions, wait = gate.versions(), gate.wait_s[name]
        lead = k - min((versions[n] for n in self.pace.live(self.run) if n != name), default=k)
        waited, self.wait_seen = wait - self.wait_seen, wait
        return _PacedStart([], waited, lead)

    def _published(self, k: int, made: Produced) -> list:
        if self.name not in made.samples:  # its worker failed and on_failure kept the run going
            raise WorkerUnavailable(f"policy {self.name!r}: generation at step {k} failed")
        assert self.current is not None
        own = self.current.extra.own = self.run.subscription.drain_deliveries()
        return [own]

    def _experience(self, incoming: list[PacedRecord]) -> list:
        self.pace.note(self.name, incoming, "consumed")
        assert self.current is not None
        return self.current.extra.own + [d for r in incoming for d in r.payload]

    def _record(self, k: int, cur: _Started, ctx: StrategyContext, stats, incoming) -> None:
        run, name = self.run, self.name
        if name not in stats:
            raise WorkerUnavailable(f"policy {name!r}: its update at step {k} failed")
        self._log_experience(ctx, k, incoming, cur)
        samples = cur.made.samples[name]
        part = policy_metrics(run, name, samples, cur.made.gen_time[name], stats[name], ctx)
        part.update({f"policy/{name}/phase/{p}_time_s": v for p, v in run.step_phases.items()})
        self.pace.rows.add(k, name, part)

    def _log_experience(self, ctx, k: int, incoming: list[PacedRecord], cur: _Started) -> None:
        """The pace of this step: how far ahead it started, how long it waited at the gate, its
        wall time with that wait, how old the peer experience it used was (in the producers'
        steps) and how many peer records it dropped as stale since its last step."""
        name, start = self.name, cur.extra
        lags = [k - (r.version - 1) for r in incoming]
        with self.pace.lock:
            dropped, self.dropped_seen = (
                self.pace.dropped[name] - self.dropped_seen,
                self.pace.dropped[name],
            )
        ctx.log(name, "pace/lead", start.lead)
        ctx.log(name, "pace/gate_wait_time_s", start.waited)
        ctx.log(name, "pace/step_wall_time_s", start.waited + time.perf_counter() - cur.t0)
        ctx.log(name, "pace/experience_records", len(incoming))
        ctx.log(name, "pace/experience_lag_mean", float(np.mean(lags)) if lags else 0.0)
        ctx.log(name, "pace/experience_lag_max", max(lags, default=0))
        ctx.log(name, "pace/stale_dropped", dropped)

    def dropped(self, records: list[PacedRecord]) -> None:
        self.pace.note(self.name, records, "dropped")
        with self.pace.lock:
            self.pace.dropped[self.name] += len(records)


# ---- the two schedules ---------------------------------------------------------------------------
class LockStep:
    """Lock-step: one member, every live policy (``LockStepper``), at a gate of one."""

    def __init__(self, run: Run, start: int) -> None:
        self.run = run
        self.gate = VersionGate([LOCK_STEP], max_staleness=0)
        for _ in range(start):
            self.gate.advance(LOCK_STEP)
        self.members = {LOCK_STEP: LockStepper(run)}

    def done(self) -> int:
        """Steps every policy has completed."""
        return self.gate.version(LOCK_STEP)

    begin = done  # the step the next segment starts at

    def reached(self, end: int) -> bool:
        return self.done() >= end

    def segment(self, end: int) -> None:
        self.gate.reopen(self.members)
        run_paced(
            cast("dict[str, StepWorker]", self.members),  # a PhasedWorker (run_paced takes both)
            end,
            self.gate,
            step_timeout_s=UNBOUNDED_S,
            on_failure="raise",
            halt=lambda: self.run.stop.requested,
        )


class Paced:
    """Paced: each policy a member of its own (``PolicyStepper``) at the run's ``Pace``."""

    def __init__(self, run: Run) -> None:
        self.run, self.pace = run, cast(Pace, run.pace)
        run.subscription.close()  # the lock-step group's; each policy here has its own
        self.members = {n: PolicyStepper(run, n, self.pace) for n in run.policies}

    def done(self) -> int:
        """Steps whose rows are written: every live policy has completed them."""
        return self.pace.rows.next

    def begin(self) -> int:
        live = self.pace.live(self.run)
        return min((self.pace.gate.version(n) for n in live), default=self.run.cfg.steps)

    def reached(self, end: int) -> bool:
        return all(self.pace.gate.version(n) >= end for n in self.pace.live(self.run))

    def segment(self, end: int) -> None:
        """The live policies' loops up to step ``end``; a failure under ``on_failure = "stop"``
        raises, and so does a guard that a row tripped (its record is written)."""
        run, pace, alloc = self.run, self.pace, self.run.cfg.allocation
        steppers = {n: self.members[n] for n in pace.live(run)}
        # the last segment's end closed the gate and its finished loops left it: open it again
        pace.gate.reopen(steppers)
        report = run_paced(
            cast("dict[str, StepWorker]", steppers),  # PhasedWorkers (run_paced takes both)
            end,
            pace.gate,
            pace.channel,
            step_timeout_s=CALLS_PER_STEP * alloc.call_timeout_s,
            on_failure="continue" if alloc.on_failure == "continue" else "stop",
            halt=lambda: run.stop.requested or pace.tripped is not None,
            keep_undelivered=True,
            on_stale=lambda consumer, records: steppers[consumer].dropped(records),
            set_aside=lambda ident: verification_seconds(run, ident),
        )
        pace.failed.update(f.worker for f in report.failures)
        pace.rows.flush()
        if report.stopped and report.failures:
            raise WorkerFailedError(list(report.failures), {})
        run.departures.check(run, end, "train", report.failures, pace.failed)
        if pace.tripped is not None:  # its record is written; the run checkpoints and stops
            raise pace.tripped


# ---- the loop ------------------------------------------------------------------------------------
def sync_points(cfg, start: int) -> int:
    """The next step after ``start`` where all policies meet: an evaluation, a checkpoint, the
    end."""
    for step in range(start + 1, cfg.steps + 1):
        if (cfg.eval.every and step % cfg.eval.every == 0) or (
            cfg.save_steps and step % cfg.save_steps == 0
        ):
            return step
    return cfg.steps


def train_loop(
    run: Run,
    start: int,
    save_checkpoint: Callable[[Run, int], None],
    stop_here: Callable[[Run, int], None],
) -> None:
    """The GRPO steps from ``start``, lock-step or paced (``run.pace``), segment by segment
    between the steps where all policies meet: there the evaluation, then the checkpoint
    (``save_checkpoint(run, step)``); a stop asked for during a segment comes after both, and
    ``stop_here(run, step)`` checkpoints the steps done and raises."""
    cfg = run.cfg
    schedule: LockStep | Paced = LockStep(run, start) if run.pace is None else Paced(run)
    run.progress.start_phase("train", cfg.steps, completed=schedule.done())
    while (begin := schedule.begin()) < cfg.steps:
        end = sync_points(cfg, begin)
        with run.timed("train"):
            schedule.segment(end)
        reached = schedule.reached(end)
        if reached and cfg.eval.every and end % cfg.eval.every == 0 and end < cfg.steps:
            evaluate(run, end)
        if run.stop.requested or not reached:
            if reached:  # its checkpoint first, which stop_here names
                save_checkpoint(run, end)
            stop_here(run, schedule.done())
        save_checkpoint(run, end)
    run.progress.finish_phase(f"{cfg.steps} steps done")
