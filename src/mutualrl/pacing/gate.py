"""Pacing of independently-timed workers: bounded staleness, freshness, starvation.

Bounded staleness (stale-synchronous parallel): a worker may *start* step ``k`` only when every
live worker has completed at least ``k - max_staleness`` steps. ``max_staleness = 0`` is lock-step;
the default 1 lets a fast policy work on step k while the slowest is still on step k-1. Failed,
removed and finished workers are not live, so they never hold the others back.

Freshness: a record produced at version ``v`` is fresh for a consumer at version ``c`` when
``c - v <= max_staleness``; older records are dropped at consumption and counted, never silently.

Every wait here has a timeout: the gate's waits are bounded, and the paced driver
(``mutualrl.pacing.driver``) declares a step that exceeds its timeout hung.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import msgspec


def is_fresh(record_version: int, consumer_version: int, max_staleness: int) -> bool:
    """Whether a record of ``record_version`` may still be used by a consumer at
    ``consumer_version``.

    Records from consumers' future (a faster producer) are always fresh."""
    return consumer_version - record_version <= max_staleness


class VersionGate:
    """Thread-safe bounded-staleness gate over named workers' versions (completed steps)."""

    def __init__(self, workers: Iterable[str], max_staleness: int = 1) -> None:
        if max_staleness < 0:
            raise ValueError(f"VersionGate: max_staleness must be >= 0, got {max_staleness}")
        self.max_staleness = max_staleness
        self._cond = threading.Condition()
        self._versions = {w: 0 for w in workers}
        self._live = set(self._versions)
        self._closed = False
        self.wait_s = {w: 0.0 for w in self._versions}

    def version(self, worker: str) -> int:
        with self._cond:
            return self._versions[worker]

    def versions(self) -> dict[str, int]:
        with self._cond:
            return dict(self._versions)

    def live(self) -> set[str]:
        with self._cond:
            return set(self._live)

    def _allowed(self, worker: str) -> bool:
        if self._closed or worker not in self._live:
            return True  # nothing to wait for: the caller re-checks why
        slowest = min(self._versions[w] for w in self._live)
        return self._versions[worker] - slowest <= self.max_staleness

    def wait_to_advance(self, worker: str, timeout_s: float) -> bool:
        """Block until ``worker`` may start its next step; False on timeout or after ``close``."""
        if worker not in self._versions:
            raise KeyError(
                f"VersionGate: unknown worker {worker!r}; known: {sorted(self._versions)}"
            )
        t0 = time.monotonic()
        with self._cond:
            ok = self._cond.wait_for(lambda: self._allowed(worker), timeout=timeout_s)
            self.wait_s[worker] += time.monotonic() - t0
            return ok and not self._closed and worker in self._live

    def advance(self, worker: str) -> int:
        """Record one completed step of ``worker``; returns its new version."""
        with self._cond:
            self._versions[worker] += 1
            self._cond.notify_all()
            return self._versions[worker]

    def remove(self, worker: str) -> None:
        """A failed, removed or finished worker stops holding the others back."""
        with self._cond:
            self._live.discard(worker)
            self._cond.notify_all()

    def close(self) -> None:
        """Wake every waiter with False (the run is stopping)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def reopen(self, workers: Iterable[str]) -> None:
        """Open a closed gate again for ``workers`` (live again, at the versions they hold): a
        run continued in a later ``run_paced`` call, e.g. after a checkpoint."""
        with self._cond:
            self._closed = False
            self._live.update(workers)
            self._cond.notify_all()


class PacedRecord(msgspec.Struct, frozen=True):
    """Experience in flight between paced workers.

    ``version`` is the producer's version when it published: its completed steps, counting the
    step that produced the record (the behaviour policy's own version travels in the payload).
    """

    producer: str
    version: int
    payload: Any


class Channel(Protocol):
    """How records move between workers (pluggable: an in-process queue, the experience bus…)."""

    def publish(self, record: PacedRecord, recipients: Sequence[str]) -> None: ...

    def take(self, consumer: str) -> list[PacedRecord]: ...  # everything waiting, non-blocking

    def drain(self) -> dict[str, list[PacedRecord]]: ...  # leftovers at the end of a run

    def pending(self) -> int: ...  # queued records, left queued

    def put_back(self, consumer: str, records: list[PacedRecord]) -> None: ...  # queue them again


class QueueChannel:
    """One unbounded thread-safe FIFO per consumer; in process, nothing is copied."""

    def __init__(self, consumers: Iterable[str]) -> None:
        self._queues: dict[str, queue.SimpleQueue] = {c: queue.SimpleQueue() for c in consumers}

    def publish(self, record: PacedRecord, recipients: Sequence[str]) -> None:
        for r in recipients:
            self._queues[r].put(record)

    def take(self, consumer: str) -> list[PacedRecord]:
        q, out = self._queues[consumer], []
        while True:
            try:
                out.append(q.get_nowait())
            except queue.Empty:
                return out

    def drain(self) -> dict[str, list[PacedRecord]]:
        return {c: self.take(c) for c in self._queues}

    def pending(self) -> int:
        return sum(q.qsize() for q in self._queues.values())

    def put_back(self, consumer: str, records: list[PacedRecord]) -> None:
        """Queue ``records`` for ``consumer`` again (a resumed run's undelivered ones)."""
        for r in records:
            self._queues[consumer].put(r)


def starvation_report(
    busy_s: dict[str, float],
    updates: dict[str, int],
    planned_share: dict[str, float],
    wait_s: dict[str, float] | None = None,
    wall_s: float | None = None,
) -> dict[str, dict[str, float]]:
    """Each worker's share of busy wall time and of updates, against its planned share.

    ``update_ratio`` = update share / planned share: 1 is as planned, below 1 the worker is
    starved (it got fewer updates than the plan gave it resources for), above 1 it ran ahead.
    ``wait_fraction`` is the part of the run it spent blocked on the staleness gate.
    """
    names = sorted(set(busy_s) | set(updates) | set(planned_share))
    total_busy = sum(busy_s.values()) or 1.0
    total_updates = sum(updates.values()) or 1
    total_plan = sum(planned_share.get(n, 0.0) for n in names)
    out: dict[str, dict[str, float]] = {}
    for n in names:
        plan = planned_share.get(n, 0.0) / total_plan if total_plan else 1.0 / len(names)
        upd = updates.get(n, 0) / total_updates
        row = {
            "wall_share": busy_s.get(n, 0.0) / total_busy,
            "update_share": upd,
            "planned_share": plan,
            "update_ratio": upd / plan if plan else float("nan"),
        }
        if wait_s is not None and wall_s:
            row["wait_fraction"] = wait_s.get(n, 0.0) / wall_s
        out[n] = row
    return out
