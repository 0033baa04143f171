"""Each policy at its own pace: ``allocation.max_staleness = k >= 1``.

Every policy runs its own step loop in a driver thread of its own (``pacing.run_paced``),
with the same phases as the lock-step loop, for itself only:

    wait at the gate -> sample prompts -> generate -> verify -> publish (to the peers at once)
    -> take the experience that has arrived -> strategy -> update -> its part of the step's row

The gate (``VersionGate``) lets a policy start step ``s`` once every live policy has completed
``s - k`` steps. What a policy publishes goes into the exchange (the experience log, the seqs) and
to each live peer as one record per step, stamped with the producer's step + 1; a receiver at
step ``s`` uses the records of steps up to ``s`` that have arrived when it builds its batches
(a peer's later steps wait in its queue until it gets there, so a step's experience is used at
that step, as in lock-step, whenever the peer is ahead), and drops (and counts) those stamped
below ``s - k``. So a strategy sees only what was published before it builds a
batch: a fast policy trains without the experience of prompts its peers have not reached yet.

Each policy has a strategy object of its own (built from the run's config), which sees its own
samples and its own experience; a strategy that needs every policy's samples of the same step
says so when it registers (``needs_lock_step``) and is refused (``check_paced``).

Evaluation and checkpoints are where all policies meet: the policies' loops run in segments up
to the next such step. A checkpoint holds each policy's own step and version, the gate, the
records in flight, each policy's strategy state and the rows not yet complete, so a resumed run
loses and replays nothing (``Pace.ledger`` says which producer steps each receiver consumed,
dropped or still has queued). ``k = 0`` is the lock-step loop (``run.loop``), bit for bit.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import defaultdict
from typing import cast

import numpy as np

from mutualrl.config import ConfigError, RunConfig
from mutualrl.pacing import PacedRecord, QueueChannel, StepWorker, VersionGate, run_paced
from mutualrl.run.evaluation import evaluate
from mutualrl.run.guards import GuardTripped
from mutualrl.run.phases import (
    Produced,
    check_guards,
    learn,
    log_pace,
    policy_metrics,
    produce,
    run_metrics,
)
from mutualrl.run.state import Run
from mutualrl.strategies import STRATEGIES, StatefulStrategy, build_strategy
from mutualrl.workers import WorkerFailedError, WorkerUnavailable

# Calls a step makes on workers (generate, the strategy's, update), each bounded by
# call_timeout_s: a step still running after this many of them is declared hung. Verification
# is bounded on its own (task.verifier_timeout_s per call) and set aside (verification_seconds).
CALLS_PER_STEP = 3


def verification_seconds(run: Run, ident: int) -> float:
    """Seconds the thread ``ident`` has spent verifying so far: the task's verifier (a strategy's
    checks included) and the reward functions. The policies take turns at them, so one policy's
    step can wait for another's verification; each call has its own time limit."""
    out = run.verifier.seconds_in_calls(ident)
    return out + (run.rewards.seconds_in_calls(ident) if run.rewards is not None else 0.0)


def check_paced(cfg: RunConfig) -> None:
    """Refuse a paced run whose strategy needs every policy to take each step together."""
    k = cfg.allocation.max_staleness
    if k < 1:
        return
    why = getattr(STRATEGIES.get(cfg.strategy), "needs_lock_step", None)
    if why:
        raise ConfigError(
            f"allocation.max_staleness = {k}: strategy {cfg.strategy!r} needs every "
            f"policy to take each step together ({why}); set max_staleness = 0 or "
            "choose another strategy"
        )


class Pace:
    """A paced run's own state: the gate, the records in flight between the policies' loops, each
    policy's strategy and own-records subscription, the rows being gathered and the books."""

    def __init__(self, run: Run) -> None:
        names = list(run.policies)
        self.gate = VersionGate(names, run.cfg.allocation.max_staleness)
        self.channel = QueueChannel(names)
        self.strategies = {n: build_strategy(run.cfg) for n in names}
        ex = run.cfg.exchange
        self.own = {
            n: run.bus.subscribe(
                kinds=None,
                producers=[n],
                name=f"paced:{n}",
                maxsize=ex.queue_size,
                overflow=ex.overflow,
                timeout=ex.block_timeout_s,
            )
            for n in names
        }
        self.failed: set[str] = set()
        self.lock = threading.Lock()
        # consumer -> producer -> "consumed" | "dropped" -> producer steps
        self.ledger: dict[str, dict[str, dict[str, list[int]]]] = {
            n: {p: {"consumed": [], "dropped": []} for p in names if p != n} for n in names
        }
        self.dropped = {n: 0 for n in names}  # records each receiver dropped as stale
        self.rows = StepRows(self, run)
        self.tripped: GuardTripped | None = None

    def live(self, run: Run) -> list[str]:
        return [n for n in run.live() if n not in self.failed]

    def note(self, consumer: str, records: list[PacedRecord], how: str) -> None:
        with self.lock:
            for r in records:
                self.ledger[consumer][r.producer][how].append(r.version - 1)

    def pending(self) -> dict[str, list[PacedRecord]]:
        """The records still queued for each receiver (left queued)."""
        held = self.channel.drain()
        for consumer, records in held.items():
            self.channel.put_back(consumer, records)
        return held

    def books(self) -> dict[str, dict[str, dict[str, list[list[int]]]]]:
        """Per receiver and producer, the producer steps whose records it consumed, dropped as
        stale, or still has queued, as [first, last] ranges: each of the producer's steps once
        over the three, however often the run was stopped and resumed."""
        queued = {c: [(r.producer, r.version - 1) for r in rs] for c, rs in self.pending().items()}
        with self.lock:
            return {
                c: {
                    p: {
                        "consumed": _ranges(b["consumed"]),
                        "dropped": _ranges(b["dropped"]),
                        "queued": _ranges([s for q, s in queued.get(c, []) if q == p]),
                    }
                    for p, b in by.items()
                }
                for c, by in self.ledger.items()
            }

    def state_dict(self) -> dict:
        strategies = {
            n: s.state_dict() for n, s in self.strategies.items() if hasattr(s, "state_dict")
        }
        return {
            "versions": self.gate.versions(),
            "wait_s": dict(self.gate.wait_s),
            "failed": sorted(self.failed),
            "queued": self.pending(),
            "strategies": strategies,
            "ledger": self.ledger,
            "dropped": dict(self.dropped),
            "rows": self.rows.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        for name, version in state["versions"].items():
            for _ in range(version):
                self.gate.advance(name)
        self.gate.wait_s.update(state["wait_s"])
        self.failed = set(state["failed"])
        for consumer, records in state["queued"].items():
            self.channel.put_back(consumer, records)
        for n in self.failed:
            self.gate.remove(n)
        for n, s in state["strategies"].items():
            cast(StatefulStrategy, self.strategies[n]).load_state_dict(s)
        self.ledger = state["ledger"]
        self.dropped.update(state["dropped"])
        self.rows.load_state_dict(state["rows"])


def _ranges(steps: list[int]) -> list[list[int]]:
    """Steps as [first, last] runs; a step listed twice shows as a run that overlaps."""
    out: list[list[int]] = []
    for step in sorted(steps):
        if out and step == out[-1][1] + 1:
            out[-1][1] = step
        else:
            out.append([step, step])
    return out


class StepRows:
    """Each step's metrics row, gathered from the policies' parts and written, in step order,
    once every live policy has given its part; the guards look at each row as it is written."""

    def __init__(self, pace: Pace, run: Run) -> None:
        self.pace, self.run = pace, run
        self.parts: dict[int, dict[str, dict]] = defaultdict(dict)
        self.next = 0
        self.lock = threading.Lock()
        self.last = time.perf_counter()

    def add(self, step: int, name: str, part: dict) -> None:
        with self.lock:
            self.parts[step][name] = part
            self._flush()

    def flush(self) -> None:
        """Write every row whose policies have all given their parts (after a failure too)."""
        with self.lock:
            self._flush()

    def _flush(self) -> None:
        live = set(self.pace.live(self.run))
        while self.next in self.parts and live <= set(self.parts[self.next]):
            self._write(self.next, self.parts.pop(self.next))
            self.next += 1

    def _write(self, step: int, parts: dict[str, dict]) -> None:
        now = time.perf_counter()
        record: dict = {"phase": "train", "step": step, "time_s": now - self.last}
        self.last = now
        for name in self.run.policies:
            record.update(parts.get(name, {}))
        record.update(run_metrics(self.run))
        record["exchange/stale_dropped"] = sum(self.pace.dropped.values())
        self.run.writer.write(record)
        self.run.progress.advance(
            " | ".join(f"{n} r={np.mean(h[-5:]):.2f}" for n, h in self.run.history.items() if h)
        )
        if self.pace.tripped is None:
            try:
                check_guards(self.run, record)
            except GuardTripped as tripped:
                self.pace.tripped = tripped  # every loop stops at its next step boundary

    def state_dict(self) -> dict:
        with self.lock:
            return {"next": self.next, "parts": {k: dict(v) for k, v in self.parts.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.next = int(state["next"])
        self.parts = defaultdict(dict, {int(k): dict(v) for k, v in state["parts"].items()})


@dataclasses.dataclass
class _Produced:
    made: Produced  # the step's first half, for this policy
    own: list  # the step's own records as the exchange delivered them
    t0: float  # when the step started (after the gate)
    busy0: float  # the worker's busy seconds then
    waited: float  # seconds it waited at the gate before the step
    lead: int  # steps ahead of the slowest live peer when it started


class PolicyStepper:
    """One policy's steps in a paced run (an ``pacing.PhasedWorker`` for ``run_paced``): the
    lock-step loop's phases, for this policy only, on a view of the run with its own strategy,
    its own-records subscription and its own phase clock."""

    def __init__(self, run: Run, name: str, pace: Pace) -> None:
        self.name, self.pace = name, pace
        self.run = dataclasses.replace(
            run,
            strategy=pace.strategies[name],
            subscription=pace.own[name],
            step_phases=defaultdict(float),
        )
        self.current: _Produced | None = None
        self.wait_seen = pace.gate.wait_s[name]
        self.dropped_seen = pace.dropped[name]

    def produce(self, k: int) -> list:
        run, name = self.run, self.name
        run.step_phases.clear()
        versions, wait = self.pace.gate.versions(), self.pace.gate.wait_s[name]
        lead = k - min((versions[n] for n in self.pace.live(run) if n != name), default=k)
        waited, self.wait_seen = wait - self.wait_seen, wait
        t0, busy0 = time.perf_counter(), run.executor.busy_seconds().get(name, 0.0)
        made = produce(run, k, [name])
        if name not in made.samples:  # its worker failed and on_failure kept the run going
            raise WorkerUnavailable(f"policy {name!r}: generation at step {k} failed")
        own = run.subscription.drain_deliveries()
        self.current = _Produced(made, own, t0, busy0, waited, lead)
        return [own]

    def learn(self, k: int, incoming: list[PacedRecord]) -> None:
        run, name, cur = self.run, self.name, self.current
        assert cur is not None, "run_paced calls learn after the step's produce"
        peers = [d for r in incoming for d in r.payload]
        self.pace.note(name, incoming, "consumed")
        versions = {name: run.versions[name]}
        ctx, stats = learn(run, cur.made, experience=cur.own + peers)
        if name not in stats:
            raise WorkerUnavailable(f"policy {name!r}: its update at step {k} failed")
        busy = run.executor.busy_seconds().get(name, 0.0) - cur.busy0
        samples = cur.made.samples
        log_pace(run, ctx, samples, {name: busy}, versions)
        self._log_experience(ctx, k, incoming, cur)
        part = policy_metrics(run, name, samples[name], cur.made.gen_time[name], stats[name], ctx)
        part.update({f"policy/{name}/phase/{p}_time_s": v for p, v in run.step_phases.items()})
        self.current = None
        self.pace.rows.add(k, name, part)

    def _log_experience(self, ctx, k: int, incoming: list[PacedRecord], cur: _Produced) -> None:
        """The pace of this step: how far ahead it started, how long it waited at the gate, its
        wall time with that wait, how old the peer experience it used was (in the producers'
        steps) and how many peer records it dropped as stale since its last step."""
        name = self.name
        lags = [k - (r.version - 1) for r in incoming]
        with self.pace.lock:
            dropped, self.dropped_seen = (
                self.pace.dropped[name] - self.dropped_seen,
                self.pace.dropped[name],
            )
        ctx.log(name, "pace/lead", cur.lead)
        ctx.log(name, "pace/gate_wait_time_s", cur.waited)
        ctx.log(name, "pace/step_wall_time_s", cur.waited + time.perf_counter() - cur.t0)
        ctx.log(name, "pace/experience_records", len(incoming))
        ctx.log(name, "pace/experience_lag_mean", float(np.mean(lags)) if lags else 0.0)
        ctx.log(name, "pace/experience_lag_max", max(lags, default=0))
        ctx.log(name, "pace/stale_dropped", dropped)

    def dropped(self, records: list[PacedRecord]) -> None:
        self.pace.note(self.name, records, "dropped")
        with self.pace.lock:
            self.pace.dropped[self.name] += len(records)


# ---- the loop ------------------------------------------------------------------------------------
def sync_points(cfg: RunConfig, start: int) -> int:
    """The next step after ``start`` where all policies meet: an evaluation, a checkpoint, the
    end."""
    for step in range(start + 1, cfg.steps + 1):
        if (cfg.eval.every and step % cfg.eval.every == 0) or (
            cfg.save_steps and step % cfg.save_steps == 0
        ):
            return step
    return cfg.steps


def paced_train_loop(run: Run, save_checkpoint, stop_here) -> None:
    """Every live policy at its own pace, segment by segment between the steps where all meet
    (``save_checkpoint(run, step)`` and ``stop_here(run, step)`` are the lock-step loop's)."""
    pace, cfg = _pace_of(run), run.cfg
    run.subscription.close()  # the lock-step loop's; each policy here has its own
    run.progress.start_phase("train", cfg.steps, completed=pace.rows.next)
    steppers = {n: PolicyStepper(run, n, pace) for n in run.policies}
    while True:
        live = pace.live(run)
        begin = min((pace.gate.version(n) for n in live), default=cfg.steps)
        if begin >= cfg.steps:
            break
        end = sync_points(cfg, begin)
        with run.timed("train"):
            _segment(run, {n: steppers[n] for n in live}, end)
        if pace.tripped is not None:  # its record is written; the run checkpoints and stops
            raise pace.tripped
        reached = all(pace.gate.version(n) >= end for n in pace.live(run))
        # every policy is at end: its evaluation, then its checkpoint (a stop asked for during
        # the segment comes after both, as in lock-step: the resumed run starts after end)
        if reached and cfg.eval.every and end % cfg.eval.every == 0 and end < cfg.steps:
            evaluate(run, end)
        if run.stop.requested or not reached:
            if reached:  # its checkpoint first, which stop_here names
                save_checkpoint(run, end)
            stop_here(run, pace.rows.next)
        save_checkpoint(run, end)
    run.progress.finish_phase(f"{cfg.steps} steps done")


def _pace_of(run: Run) -> Pace:
    """The paced run's ``Pace``, which ``run.build`` made (``Run.pace`` names only what the run
    itself uses of it)."""
    return cast(Pace, run.pace)


def _segment(run: Run, steppers: dict[str, PolicyStepper], end: int) -> None:
    """The policies' loops up to step ``end``; a failure under ``on_failure = "stop"`` raises."""
    pace, alloc = _pace_of(run), run.cfg.allocation
    # the last segment's end closed the gate and its finished loops left it: open it again
    pace.gate.reopen(steppers)
    report = run_paced(
        # PolicySteppers are PhasedWorkers, which run_paced takes too (its docstring); its
        # annotation names only StepWorker
        cast("dict[str, StepWorker]", steppers),
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


def pace_summary(rows: list[dict], names: list[str]) -> dict[str, dict[str, float | None]]:
    """Per policy, over a run's train rows (lock-step or paced): steps, wall seconds (a paced
    step's with its gate wait; a lock-step step's whole), seconds its worker was busy, the idle
    fraction of its wall time, steps a minute, and for paced runs the gate wait, the mean age of
    the peer experience it used (in producer steps) and the peer records it dropped as stale."""
    out: dict[str, dict[str, float | None]] = {}
    for n in names:
        p = f"policy/{n}/"
        mine = [r for r in rows if r.get("phase") == "train" and p + "reward/mean" in r]
        wall = sum(r.get(p + "pace/step_wall_time_s", r.get("time_s", 0.0)) or 0.0 for r in mine)
        timed = [r[p + "pace/busy_time_s"] for r in mine if p + "pace/busy_time_s" in r]
        # None: no busy time in the rows (a Ray run written before its executor measured it)
        busy = sum(timed) if timed else None
        used = sum(r.get(p + "pace/experience_records") or 0.0 for r in mine)
        lag = sum(
            (r.get(p + "pace/experience_lag_mean") or 0.0)
            * (r.get(p + "pace/experience_records") or 0.0)
            for r in mine
        )
        out[n] = {
            "steps": len(mine),
            "wall_s": wall,
            "busy_s": busy,
            "idle_fraction": (max(0.0, 1 - busy / wall) if wall else 0.0)
            if busy is not None
            else None,
            "steps_per_min": 60 * len(mine) / wall if wall else 0.0,
            "gate_wait_s": sum(r.get(p + "pace/gate_wait_time_s") or 0.0 for r in mine),
            "experience_lag_mean": lag / used if used else 0.0,
            "stale_dropped": sum(r.get(p + "pace/stale_dropped") or 0.0 for r in mine),
        }
    return out
