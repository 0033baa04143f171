"""A paced run's own state: ``allocation.max_staleness = k >= 1``, each policy at its own pace.

Each policy is a member of the version gate of its own (``run.schedule.PolicyStepper``, driven
by ``pacing.run_paced``), taking the same phases as a lock-step run, for itself only:

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

Evaluation and checkpoints are where all policies meet (``run.schedule.train_loop``). A
checkpoint holds each policy's own step and version, the gate, the records in flight, each
policy's strategy state and the rows not yet complete (``Pace.state_dict``), so a resumed run
loses and replays nothing (``Pace.ledger`` says which producer steps each receiver consumed,
dropped or still has queued).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import cast

import numpy as np

from mutualrl.config import ConfigError, RunConfig
from mutualrl.pacing import PacedRecord, QueueChannel, VersionGate
from mutualrl.run.guards import GuardTripped
from mutualrl.run.phases import check_guards, run_metrics
from mutualrl.run.state import Run
from mutualrl.strategies import STRATEGIES, StatefulStrategy, build_strategy


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
