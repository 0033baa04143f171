"""The local executor: workers in this process, one thread each or one after another.

Executors realise a plan: they build workers from factories and apply typed calls
(``mutualrl.workers.calls``) to them, all at once, each bounded by a timeout; failures and the
``on_failure`` policy are described there. Kinds are a registry (``workers.kinds``): ``local``
(this module, the default) and ``ray``.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING, Any

from mutualrl.config import AllocationConfig
from mutualrl.workers.calls import (
    CallResult,
    WorkerCall,
    WorkerFailure,
    close_worker,
    failure_from_exception,
)
from mutualrl.workers.replies import failure_result
from mutualrl.workers.roster import Roster, check_built

if TYPE_CHECKING:
    from mutualrl.allocation.planner import Plan


class _WorkerThread:
    """One daemon thread per worker with a mailbox.

    Not a ThreadPoolExecutor: its threads are joined at interpreter exit, so one hung worker
    would hang the process forever. A daemon thread can be abandoned once it is reported hung.
    """

    def __init__(self, name: str) -> None:
        self._mail: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=f"mutualrl-{name}", daemon=True)
        self.thread.start()

    def submit(self, fn: Callable[[], Any]) -> Future:
        fut: Future = Future()
        self._mail.put((fn, fut))
        return fut

    def _loop(self) -> None:
        while (item := self._mail.get()) is not None:
            fn, fut = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as exc:  # reported to the caller, never swallowed
                    fut.set_exception(exc)

    def stack(self) -> str:
        frame = sys._current_frames().get(self.thread.ident or -1)
        return "".join(traceback.format_stack(frame)) if frame is not None else ""

    def close(self) -> None:
        self._mail.put(None)


def _set_torch_threads(n: int) -> None:
    import torch

    torch.set_num_threads(max(1, n))


class LocalExecutor:
    """Workers in this process: one thread each (``threads``) or one after another (``sequential``).

    CPU threads from the plan: ``torch.set_num_threads`` is process-global, so per-worker shares
    cannot be honoured while workers run concurrently. ``threads`` mode sets it once to the
    smallest planned share (concurrent workers then never use more cores than the plan has);
    ``sequential`` mode sets each worker's own share before each of its calls, which is exact.
    Use the Ray executor (one process per worker) for exact shares with concurrency.
    Timeouts: enforced in ``threads`` mode; ``sequential`` mode runs in the caller's thread and
    cannot preempt a call, so it is for debugging and for checking that both modes agree.
    """

    def __init__(self, alloc: AllocationConfig | None = None, mode: str | None = None) -> None:
        self.alloc = alloc or AllocationConfig()
        self.mode = mode or self.alloc.local_mode
        self.roster = Roster(self.alloc, self._remove)
        self._workers: dict[str, object] = {}
        self._threads: dict[str, _WorkerThread] = {}
        self._planned_threads: dict[str, int] = {}
        # Calls may come from several driver threads at once (a paced run steps each policy in a
        # thread of its own): the worker threads' books are guarded, as the roster's are.
        self._lock = threading.RLock()

    def start(self, factories: dict[str, Callable[[], object]], plan: Plan | None = None) -> None:
        self.roster.factories = dict(factories)
        if plan is not None:
            self._planned_threads = {
                a.worker: a.threads for a in plan.assignments if a.worker in factories
            }
            shares = [t for t in self._planned_threads.values() if t > 0]
            if self.mode == "threads" and shares:
                _set_torch_threads(min(shares))
        results = self._run(
            {n: (lambda n=n: self._build(n)) for n in factories},
            "__init__",
            self.alloc.call_timeout_s,
        )
        check_built(results, self.shutdown)

    def _build(self, name: str) -> None:
        self._workers[name] = self.roster.factories[name]()

    def put(self, obj: Any) -> Any:
        return obj  # in process nothing is copied: the object itself is the reference

    def live_workers(self) -> list[str]:
        return self.roster.live()

    def removed(self) -> dict[str, WorkerFailure]:
        return self.roster.removed()

    def worker(self, name: str) -> object:
        """The object a worker runs (in process)."""
        return self._workers[name]

    def call(
        self, calls: dict[str, WorkerCall], timeout_s: float | None = None, *, fetch: bool = True
    ) -> dict[str, CallResult]:
        """Apply each named worker's call at once; one ``CallResult`` per name (``fetch`` is the
        Ray executor's: in process nothing is copied)."""

        def send(live: dict[str, WorkerCall], method: str, timeout: float) -> dict[str, CallResult]:
            jobs = {n: (lambda n=n, c=c: self._invoke(n, c)) for n, c in live.items()}
            return self._run(jobs, method, timeout)

        return self.roster.call(calls, timeout_s, send)

    def busy_seconds(self) -> dict[str, float]:
        """Seconds each worker has spent inside calls so far (its idle time is the rest)."""
        return self.roster.busy_seconds()

    def _invoke(self, name: str, call: WorkerCall) -> Any:
        if self.mode == "sequential" and self._planned_threads.get(name):
            _set_torch_threads(self._planned_threads[name])
        t0 = time.perf_counter()
        try:
            return call(self._workers[name])
        finally:
            self.roster.add_busy(name, time.perf_counter() - t0)

    def _run(
        self, jobs: dict[str, Callable[..., Any]], method: str, timeout_s: float
    ) -> dict[str, CallResult]:
        if self.mode == "sequential":
            return {n: self._outcome(n, method, _done_future(job)) for n, job in jobs.items()}
        with self._lock:
            for n in jobs:
                if n not in self._threads:
                    self._threads[n] = _WorkerThread(n)
            futures = {n: self._threads[n].submit(job) for n, job in jobs.items()}
        wait_futures(list(futures.values()), timeout=timeout_s)
        return {n: self._outcome(n, method, fut, timeout_s) for n, fut in futures.items()}

    def _outcome(self, name: str, method: str, fut: Future, timeout_s: float = 0.0) -> CallResult:
        if not fut.done():
            return failure_result(
                name,
                method,
                "TimeoutError",
                f"no result within {timeout_s:g} s; its thread is abandoned",
                kind="timeout",
                traceback=f"where it was when abandoned:\n{self._threads[name].stack()}",
            )
        try:
            return CallResult(name, value=fut.result(timeout=0))
        except KeyboardInterrupt:
            raise
        except (FutureTimeout, BaseException) as exc:  # SystemExit in a worker is a failure too
            return CallResult(name, failure=failure_from_exception(name, method, exc))

    def _abandon(self, name: str) -> None:
        # A hung thread cannot be killed; it is daemonic and unreferenced, so it dies with us.
        with self._lock:
            t = self._threads.pop(name, None)
        if t is not None:
            t.close()

    def _remove(self, name: str) -> None:
        self._abandon(name)
        if name in self._workers:
            close_worker(name, self._workers.pop(name))

    def shutdown(self) -> None:
        for name in list(self._threads):
            self._abandon(name)
        for name in list(self._workers):
            close_worker(name, self._workers.pop(name))


def _done_future(job: Callable[[], Any]) -> Future:
    fut: Future = Future()
    try:
        fut.set_result(job())
    except Exception as exc:  # KeyboardInterrupt still reaches the user in sequential mode
        fut.set_exception(exc)
    return fut
