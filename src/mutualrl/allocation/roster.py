"""Which workers an executor runs and what became of them: the books every executor kind keeps.

Each kind hosts its workers its own way (``local``: a thread each in this process; ``process``: a
process per worker or rank; ``ray``: an actor per worker or rank) and keeps the same books about
them in a ``Roster``: the factories it started, the live workers and those removed under
``on_failure = "continue"`` with the failure that removed them, and the seconds each has spent
inside calls. A call takes one course on every kind (``Roster.call``): its names are checked, it
goes to the live workers only, a removed one's result says it is ``unavailable``, and then
``on_failure`` applies to the results (``calls.FailurePolicy``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

from mutualrl.allocation.calls import (
    CallResult,
    FailurePolicy,
    WorkerCall,
    WorkerFailedError,
    WorkerFailure,
    call_name,
    check_names,
)

if TYPE_CHECKING:
    from mutualrl.config import AllocationConfig

# Sends each named worker its call and gathers their results: (calls, method) -> results.
Send = Callable[[dict[str, WorkerCall], str], dict[str, CallResult]]


def _hold_nothing(names: list[str]) -> AbstractContextManager[None]:
    return contextlib.nullcontext()


class Roster:
    """An executor's workers: which it started, which are live, which were removed and why, and
    how long each has been busy. ``restart(name)`` and ``remove(name)`` are the executor's own
    ways to rebuild or drop a failed worker (``on_failure``)."""

    def __init__(
        self,
        alloc: AllocationConfig,
        restart: Callable[[str], None],
        remove: Callable[[str], None],
    ) -> None:
        self.policy = FailurePolicy(alloc)
        self.factories: dict[str, Callable[[], object]] = {}
        self._restart = restart
        self._remove = remove
        # Calls may come from several driver threads at once (a paced run steps each policy in a
        # thread of its own): the books are guarded; waiting for results is not.
        self.lock = threading.RLock()
        self._busy: dict[str, float] = {}

    def live(self) -> list[str]:
        return [n for n in self.factories if n not in self.policy.removed]

    def removed(self) -> dict[str, WorkerFailure]:
        """Workers removed under ``on_failure = "continue"``, each with the failure that did it."""
        return dict(self.policy.removed)

    def add_busy(self, name: str, seconds: float) -> None:
        with self.lock:
            self._busy[name] = self._busy.get(name, 0.0) + seconds

    def busy_seconds(self) -> dict[str, float]:
        with self.lock:
            return dict(self._busy)

    def call(
        self,
        calls: dict[str, WorkerCall],
        send: Send,
        hold: Callable[[list[str]], AbstractContextManager[None]] = _hold_nothing,
    ) -> dict[str, CallResult]:
        """Each named worker's result, in the order of ``calls``: ``send`` gets the live ones'
        calls; ``hold(names)`` is held from the send to the end of ``on_failure`` (the process
        executor's pipes: one call at a time each, a restart included)."""
        method = call_name(next(iter(calls.values()))) if calls else "call"
        check_names(method, calls, self.factories)
        with hold(sorted(calls)):
            with self.lock:
                live = {n: c for n, c in calls.items() if n not in self.policy.removed}
            results = send(live, method)
            with self.lock:
                for n in calls:
                    if n not in live:
                        results[n] = self.policy.unavailable(n, method)
            # Not under the lock: a restart rebuilds its worker (seconds for a real model), and the
            # other workers' calls, from other driver threads, go on meanwhile.
            self.policy.apply(results, self._restart, self._remove)
        return {n: results[n] for n in calls}


def check_built(results: dict[str, CallResult], shutdown: Callable[[], None]) -> None:
    """After the workers were first built: if any failed, every worker is shut down and
    ``WorkerFailedError`` carries every result."""
    failures = [r.failure for r in results.values() if r.failure is not None]
    if failures:
        shutdown()
        raise WorkerFailedError(failures, results)


def check_rebuilt(name: str, results: dict[str, CallResult]) -> None:
    """After a restart rebuilt ``name``: a failure to rebuild is a failure of the restart."""
    if not results[name].ok:
        raise RuntimeError(f"restart of worker {name!r} failed: {results[name].failure}")
