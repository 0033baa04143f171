"""Run independently-paced workers, each in its own step loop, sharing experience as they go.

``run_paced`` gives every worker a daemon thread that repeats: wait at the staleness gate, take
its incoming records (fresh ones handed over, stale ones dropped and counted), ``step(k,
incoming) -> outgoing``, publish the outgoing records to every live peer, advance the gate. The
calling thread supervises: a step that raises is reported with its traceback; a step that runs
past ``step_timeout_s`` (less the seconds ``set_aside`` names) is declared hung, reported with
the stack where it hangs, and abandoned
(its thread is daemonic; a late result is discarded). The failed worker leaves the gate so the
others go on without its experience. Then ``on_failure``: ``stop`` ends the run cleanly (steps
in flight finish and publish; everything so far is in the report), ``continue`` goes on without
it, ``raise`` stops as ``stop`` does and then raises the step's own exception in the calling
thread (a lock-step run's one worker: its errors are the run's, whatever their type).
Restarting is the run's (``run.restarts``: back to the last checkpoint, every worker rebuilt),
not the pacer's.

Accounting invariant (checked by ``PacedReport.balanced``): every delivery of a record to a
recipient is either consumed, dropped as stale, or left undelivered when the run ended.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, Literal, Protocol

import msgspec

from mutualrl.pacing.gate import Channel, PacedRecord, QueueChannel, VersionGate, is_fresh
from mutualrl.workers.calls import WorkerFailedError, WorkerFailure, failure_from_exception


class StepWorker(Protocol):
    """One step: the records the worker was handed (fresh ones) in, the records it made out."""

    def step(self, k: int, incoming: list[PacedRecord]) -> list[Any]: ...


class PhasedWorker(Protocol):
    """A step in two phases around the exchange, as a GRPO step is: ``produce`` makes the step's
    records (e.g. its samples), which go to the peers at once; ``learn`` then takes what has
    arrived by then from steps up to its own (the peers' fresh ones; records of a peer's later
    steps wait until it gets there) and uses it. Publishing early and consuming late gives the
    peers the most of each other's experience the gate allows."""

    def produce(self, k: int) -> list[Any]: ...

    def learn(self, k: int, incoming: list[PacedRecord]) -> None: ...


class PacedReport(msgspec.Struct, kw_only=True):
    steps_completed: dict[str, int]
    failures: list[WorkerFailure]
    produced: dict[str, int]  # records each worker published
    deliveries: int  # records x recipients
    consumed: dict[str, int]  # records handed to each worker's step
    dropped_stale: dict[str, int]  # records each worker received too old to use
    undelivered: int  # still queued when the run ended (e.g. for a failed worker)
    busy_s: dict[str, float]  # time inside step()
    wait_s: dict[str, float]  # time blocked at the staleness gate
    wall_s: float
    stopped: bool  # ended early because of a failure under "stop"

    def balanced(self) -> bool:
        return self.deliveries == (
            sum(self.consumed.values()) + sum(self.dropped_stale.values()) + self.undelivered
        )


class _Run:
    """Shared state of one paced run; every field touched by several threads is under ``lock``."""

    def __init__(
        self,
        names: list[str],
        steps: int,
        gate: VersionGate,
        channel: Channel,
        step_timeout_s: float,
        max_age: int | None = None,
    ) -> None:
        self.steps, self.gate, self.channel, self.step_timeout_s = (
            steps,
            gate,
            channel,
            step_timeout_s,
        )
        self.max_age = gate.max_staleness if max_age is None else max_age
        self.lock = threading.Lock()
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.stop = threading.Event()
        self.tokens = {n: 0 for n in names}  # bumped to disown an abandoned thread
        self.threads: dict[str, threading.Thread] = {}
        self.in_step: dict[str, float | None] = {n: None for n in names}  # step start time
        self.set_aside: Callable[[int], float] | None = None
        self.aside_at_start: dict[str, float] = {n: 0.0 for n in names}
        self.produced = {n: 0 for n in names}
        self.consumed = {n: 0 for n in names}
        self.dropped = {n: 0 for n in names}
        self.busy = {n: 0.0 for n in names}
        self.deliveries = 0
        # Who receives records: every worker of the run but the failed ones. A worker whose loop
        # has finished still does (a later run_paced call may continue it); what it has not
        # taken when the run ends is counted undelivered.
        self.recipients = set(names)
        self.halt: Callable[[], bool] | None = None  # asked from outside to stop at a step boundary
        self.errors: list[BaseException] = []  # what the failed steps raised, in order
        self.on_stale: Callable[[str, list[PacedRecord]], None] | None = None

    def owns(self, name: str, token: int) -> bool:
        with self.lock:
            return self.tokens[name] == token

    def consume(self, name: str, k: int, hold_ahead: bool = False) -> list[PacedRecord]:
        """The fresh records queued for ``name`` at its step ``k`` (stale ones dropped, counted).
        ``hold_ahead``: records of a producer's step after ``k`` stay queued until the consumer
        gets there (a step's experience is used at that step, as in lock-step)."""
        records = self.channel.take(name)
        if hold_ahead:
            ahead = [r for r in records if r.version - 1 > k]
            if ahead:
                self.channel.put_back(name, ahead)
                records = [r for r in records if r.version - 1 <= k]
        fresh, stale = [], []
        for r in records:
            (fresh if is_fresh(r.version, k, self.max_age) else stale).append(r)
        with self.lock:
            self.consumed[name] += len(fresh)
            self.dropped[name] += len(stale)
        if self.on_stale is not None and stale:
            self.on_stale(name, stale)
        return fresh

    def publish(self, name: str, token: int, k: int, payloads: list[Any]) -> bool:
        """Send a step's records to every live peer, atomically with the ownership check, so a
        disowned thread can never publish after the report has been drained."""
        with self.lock:
            return self._publish(name, token, k, payloads)

    def _publish(self, name: str, token: int, k: int, payloads: list[Any]) -> bool:
        if self.tokens[name] != token:
            return False  # declared hung meanwhile: this late result is not ours to publish
        peers = sorted(self.recipients - {name})
        for p in payloads:
            # Stamped k + 1: the producer's version once this step is done, so under the
            # gate a lock-step peer's latest experience has age 0 and never looks stale.
            self.channel.publish(PacedRecord(name, k + 1, p), peers)
        self.produced[name] += len(payloads)
        self.deliveries += len(payloads) * len(peers)
        return True

    def finish_step(self, name: str, token: int, k: int, t0: float, payloads: list[Any]) -> bool:
        """Publish a step's records and advance (atomically with the ownership check)."""
        with self.lock:
            if not self._publish(name, token, k, payloads):
                return False
            self.in_step[name] = None
            self.busy[name] += time.monotonic() - t0
            self.gate.advance(name)
            return True

    def halted(self, name: str, token: int) -> bool:
        return (
            self.stop.is_set()
            or not self.owns(name, token)
            or (self.halt is not None and self.halt())
        )


def _loop(run: _Run, name: str, token: int, worker: StepWorker | PhasedWorker) -> None:
    try:
        for k in range(run.gate.version(name), run.steps):
            while not run.gate.wait_to_advance(name, timeout_s=run.step_timeout_s):
                if run.halted(name, token):
                    break
            if run.halted(name, token):
                break
            t0 = time.monotonic()
            aside = run.set_aside(threading.get_ident()) if run.set_aside is not None else 0.0
            with run.lock:
                run.in_step[name], run.aside_at_start[name] = t0, aside
            if not _one_step(run, name, token, worker, k, t0):
                return
        run.events.put(("done", name, token, None))
    except BaseException as exc:  # reported by the supervisor, never swallowed
        run.events.put(("failed", name, token, exc))


def _one_step(run: _Run, name: str, token: int, worker, k: int, t0: float) -> bool:
    """Step ``k`` of one worker, its records published; False when the thread was disowned."""
    if hasattr(worker, "produce"):
        if not run.publish(name, token, k, list(worker.produce(k) or [])):
            return False
        worker.learn(k, run.consume(name, k, hold_ahead=True))
        return run.finish_step(name, token, k, t0, [])
    out = list(worker.step(k, run.consume(name, k)) or [])
    return run.finish_step(name, token, k, t0, out)


def _launch(run: _Run, name: str, worker: StepWorker) -> None:
    with run.lock:
        run.tokens[name] += 1
        token = run.tokens[name]
        run.in_step[name] = None
    t = threading.Thread(
        target=_loop, args=(run, name, token, worker), daemon=True, name=f"mutualrl-paced-{name}"
    )
    run.threads[name] = t
    t.start()


def _hung(run: _Run) -> list[WorkerFailure]:
    now, out = time.monotonic(), []
    with run.lock:
        for name, t0 in run.in_step.items():
            if t0 is None or now - t0 <= run.step_timeout_s:
                continue
            aside = 0.0
            if run.set_aside is not None:  # time in work bounded on its own does not count
                aside = run.set_aside(run.threads[name].ident or -1) - run.aside_at_start[name]
            if now - t0 - aside > run.step_timeout_s:
                run.tokens[name] += 1  # disown the thread: its late output is discarded
                run.in_step[name] = None
                frame = sys._current_frames().get(run.threads[name].ident or -1)
                where = "".join(traceback.format_stack(frame)) if frame is not None else ""
                out.append(
                    WorkerFailure(
                        worker=name,
                        method="step",
                        exc_type="TimeoutError",
                        kind="timeout",
                        message=f"step ran past {run.step_timeout_s:g} s"
                        + (f" (besides {aside:.1f} s set aside)" if aside else "")
                        + "; its thread is abandoned",
                        traceback=f"where it was when abandoned:\n{where}",
                    )
                )
    return out


def _finished_or_failed(run: _Run, active: set[str], poll_s: float) -> list[WorkerFailure]:
    """Wait (at most ``poll_s``) for one worker thread to report; finished ones leave the gate."""
    try:
        kind, name, token, exc = run.events.get(timeout=poll_s)
    except queue.Empty:
        return []
    if not run.owns(name, token):
        return []  # an abandoned thread reporting late
    if kind == "done":
        active.discard(name)
        run.gate.remove(name)
        return []
    run.errors.append(exc)
    return [failure_from_exception(name, "step", exc)]


def run_paced(
    workers: dict[str, StepWorker],
    steps: int,
    gate: VersionGate,
    channel: Channel | None = None,
    *,
    step_timeout_s: float,
    on_failure: Literal["stop", "continue", "raise"] = "stop",
    max_age: int | None = None,
    poll_s: float = 0.01,
    halt: Callable[[], bool] | None = None,
    keep_undelivered: bool = False,
    on_stale: Callable[[str, list[PacedRecord]], None] | None = None,
    set_aside: Callable[[int], float] | None = None,
) -> PacedReport:
    """Run every worker from the version the gate holds for it up to ``steps``; see the module
    docstring. Workers are ``StepWorker``s or ``PhasedWorker``s.

    ``max_age``: the freshness bound at consumption (None: the gate's ``max_staleness``); a
    consumer that has completed k steps uses records stamped v only if k - v <= max_age.
    ``halt``: asked before each step; once it says True every worker stops at its next step
    boundary (e.g. the run was asked to stop), each at its own version. ``keep_undelivered``:
    leave the records still queued in ``channel`` for a later call that continues the run
    (they are counted in ``undelivered`` either way). ``on_stale(consumer, records)``: told of
    the records a consumer dropped as too old, as they are dropped. ``set_aside(ident)``: the
    seconds the thread ``ident`` has spent so far in work that bounds itself (a training run's
    verification: each call under ``task.verifier_timeout_s``); a step's time-out does not count
    the part of them spent during the step."""
    names = list(workers)
    run = _Run(names, steps, gate, channel or QueueChannel(names), step_timeout_s, max_age)
    run.halt, run.on_stale, run.set_aside = halt, on_stale, set_aside
    failures: list[WorkerFailure] = []
    active = set(names)
    t_start = time.monotonic()
    for n in names:
        _launch(run, n, workers[n])
    while active and not run.stop.is_set():
        for f in _hung(run) + _finished_or_failed(run, active, poll_s):
            failures.append(f)
            gate.remove(f.worker)
            with run.lock:
                run.recipients.discard(f.worker)
            active.discard(f.worker)
            if on_failure != "continue":
                run.stop.set()
    stopped = run.stop.is_set()
    _wind_down(run, active)
    report = _report(run, failures, stopped, time.monotonic() - t_start, keep_undelivered)
    if on_failure == "raise" and failures:
        if run.errors:
            raise run.errors[0]
        raise WorkerFailedError(failures, {})  # a hung step: nothing was raised
    return report


def _wind_down(run: _Run, active: set[str]) -> None:
    """Stop: wake gate waiters, let steps in flight finish (bounded), disown the rest."""
    run.stop.set()
    run.gate.close()
    deadline = time.monotonic() + run.step_timeout_s
    for name in sorted(active):
        run.threads[name].join(timeout=max(0.0, deadline - time.monotonic()))
    with run.lock:
        for name in run.tokens:
            run.tokens[name] += 1  # anything still running is abandoned; no late publishes


def _report(
    run: _Run,
    failures: list[WorkerFailure],
    stopped: bool,
    wall_s: float,
    keep_undelivered: bool = False,
) -> PacedReport:
    with run.lock:
        undelivered = (
            run.channel.pending()
            if keep_undelivered
            else sum(len(v) for v in run.channel.drain().values())
        )
        return PacedReport(
            steps_completed=run.gate.versions(),
            failures=failures,
            produced=dict(run.produced),
            deliveries=run.deliveries,
            consumed=dict(run.consumed),
            dropped_stale=dict(run.dropped),
            undelivered=undelivered,
            busy_s=dict(run.busy),
            wait_s=dict(run.gate.wait_s),
            wall_s=wall_s,
            stopped=stopped,
        )
