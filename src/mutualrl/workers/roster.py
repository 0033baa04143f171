"""Which workers an executor runs and what became of them: the books every executor kind keeps.

Each kind hosts its workers its own way (``local``: a thread each in this process; ``process``: a
process per worker or rank; ``ray``: an actor per worker or rank) and keeps the same books about
them in a ``Roster``: the factories it started, the live workers and those removed under
``on_failure = "continue"`` with the failure that removed them, and the seconds each has spent
inside calls. A call takes one course on every kind (``Roster.call``): its names are checked, it
goes to the live workers only, a removed one's result says it is ``unavailable``, and then
``on_failure`` applies to the results (``calls.FailurePolicy``). A worker that is a rank group
(``workers.ranks``) gets one host per rank on the kinds that start processes, each built by its
``RankFactory``, with the group's rendezvous port and an equal share of its planned threads.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

from mutualrl.workers.calls import (
    CallResult,
    FailurePolicy,
    WorkerCall,
    WorkerFailedError,
    WorkerFailure,
    call_name,
    check_names,
)
from mutualrl.workers.ranks import RankFactory, RankGroup

if TYPE_CHECKING:
    from mutualrl.config import AllocationConfig

# Sends each named worker its call and gathers their results: (calls, method, timeout_s) -> results.
Send = Callable[[dict[str, WorkerCall], str, float], dict[str, CallResult]]


def _hold_nothing(names: list[str]) -> AbstractContextManager[None]:
    return contextlib.nullcontext()


class Roster:
    """An executor's workers: which it started, which are live, which were removed and why, and
    how long each has been busy. ``remove(name)`` is the executor's own way to drop a failed
    worker (``on_failure = "continue"``)."""

    def __init__(self, alloc: AllocationConfig, remove: Callable[[str], None]) -> None:
        self.alloc = alloc
        self.policy = FailurePolicy(alloc)
        self.factories: dict[str, Callable[[], object]] = {}
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
        timeout_s: float | None,
        send: Send,
        hold: Callable[[list[str]], AbstractContextManager[None]] = _hold_nothing,
    ) -> dict[str, CallResult]:
        """Each named worker's result, in the order of ``calls``: ``send`` gets the live ones'
        calls and their timeout (``allocation.call_timeout_s`` unless ``timeout_s``);
        ``hold(names)`` is held from the send to the end of ``on_failure`` (the process
        executor's pipes: one call at a time each)."""
        method = call_name(next(iter(calls.values()))) if calls else "call"
        check_names(method, calls, self.factories)
        with hold(sorted(calls)):
            with self.lock:
                live = {n: c for n, c in calls.items() if n not in self.policy.removed}
            results = send(live, method, timeout_s or self.alloc.call_timeout_s)
            with self.lock:
                for n in calls:
                    if n not in live:
                        results[n] = self.policy.unavailable(n, method)
            # Not under the lock: removing a worker closes it, and the other workers' calls, from
            # other driver threads, go on meanwhile.
            self.policy.apply(results, self._remove)
        return {n: results[n] for n in calls}

    def rank_factories(self, name: str) -> list[RankFactory]:
        """What each rank of rank group ``name`` runs: join the group, then build its worker."""
        group = self.factories[name]
        assert isinstance(group, RankGroup)
        timeouts = (self.alloc.process_group_timeout_s, self.alloc.call_timeout_s)
        return [RankFactory(group, rank, *timeouts) for rank in range(group.ranks)]

    def rank_port(self, name: str) -> int | None:
        """Rank group ``name``'s rendezvous port when ``allocation.master_port`` is set: that port
        for the first group by name, the next one for the next; else None (a free one is taken)."""
        if not self.alloc.master_port:
            return None
        groups = sorted(n for n, f in self.factories.items() if isinstance(f, RankGroup))
        return self.alloc.master_port + groups.index(name)


def rank_threads(threads: int, ranks: int) -> int:
    """Each rank's share of its worker's planned CPU threads: an equal one, at least one (0: the
    plan set none)."""
    return max(threads // ranks, 1) if threads else 0


def check_rank_gpus(name: str, ranks: int, gpus: int) -> None:
    """A worker of ``ranks`` ranks that was planned GPUs needs one per rank."""
    if gpus and gpus < ranks:
        raise ValueError(
            f"worker {name!r} runs as {ranks} ranks but was planned {gpus} GPU(s): one GPU per rank"
        )


def check_built(results: dict[str, CallResult], shutdown: Callable[[], None]) -> None:
    """After the workers were first built: if any failed, every worker is shut down and
    ``WorkerFailedError`` carries every result."""
    failures = [r.failure for r in results.values() if r.failure is not None]
    if failures:
        shutdown()
        raise WorkerFailedError(failures, results)
