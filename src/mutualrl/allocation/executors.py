"""Executors realise a plan: they build workers from factories and call a method on all at once.

A worker is any Python object; the loop calls ``executor.call("generate", {name: kwargs, ...})``
and gets one ``CallResult`` per named worker — a value or a ``WorkerFailure`` (``raised`` with the
worker's traceback, ``timeout`` with the stack where it hangs when that can be read, or
``unavailable`` for a worker removed earlier). Every call is bounded by a timeout.

Failure policy (``[allocation] on_failure``), applied after all results of a call are in:

* ``stop``     — ``call`` raises ``WorkerFailedError`` carrying every result, so the loop can
  write what it has and stop cleanly;
* ``continue`` — the failed worker is removed; later calls report it ``unavailable``;
* ``restart``  — the worker is rebuilt from its factory (at most ``max_restarts`` times; beyond
  that, as ``stop``). The failed call is *not* retried: methods need not be idempotent, so the loop
  decides. Checkpoint contract: if the rebuilt object has ``load_checkpoint()`` (no arguments), it
  is called once, before any other method; the worker itself knows where its last checkpoint is
  (its factory closes over the run directory) and returns with the state of that checkpoint. If
  it raises, the restart counts as a failure.

Kinds are a registry (``EXECUTORS``): ``local`` (this process, the default) and ``ray``.
"""

from __future__ import annotations

import queue
import sys
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import msgspec

from mutualrl.allocation.config import AllocationConfig
from mutualrl.allocation.planner import Plan
from mutualrl.registry import Registry

FailureKind = Literal["raised", "timeout", "unavailable"]


class WorkerFailure(msgspec.Struct, frozen=True, kw_only=True):
    worker: str
    method: str
    exc_type: str
    message: str
    traceback: str
    kind: FailureKind

    def __str__(self) -> str:
        return f"worker {self.worker!r} {self.method}(): {self.kind}: {self.exc_type}: {self.message}"


@dataclass(frozen=True)
class CallResult:
    """The outcome of one worker's call: ``value`` when ``ok``, else ``failure``."""

    worker: str
    value: Any = None
    failure: WorkerFailure | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None


class WorkerFailedError(RuntimeError):
    """A call failed under ``on_failure = "stop"``; ``results`` holds every worker's outcome."""

    def __init__(self, failures: list[WorkerFailure], results: dict[str, CallResult]) -> None:
        self.failures = failures
        self.results = results
        details = "\n".join(f"{f}\n{f.traceback}" for f in failures)
        super().__init__(f"{len(failures)} worker(s) failed, stopping:\n{details}")


class Executor(Protocol):
    def start(self, factories: dict[str, Callable[[], object]], plan: Plan | None = None) -> None: ...

    def call(self, method: str, kwargs: dict[str, dict], timeout_s: float | None = None, *,
             fetch: bool = True) -> dict[str, CallResult]: ...

    def put(self, obj: Any) -> Any: ...

    def live_workers(self) -> list[str]: ...

    def shutdown(self) -> None: ...


EXECUTORS: Registry[Callable[[AllocationConfig], Executor]] = Registry("executor kind")


def make_executor(alloc: AllocationConfig) -> Executor:
    return EXECUTORS.get(alloc.executor)(alloc)


def failure_from_exception(worker: str, method: str, exc: BaseException) -> WorkerFailure:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return WorkerFailure(worker=worker, method=method, exc_type=type(exc).__name__,
                         message=str(exc), traceback=tb, kind="raised")


def check_names(method: str, kwargs: dict[str, dict], known: dict) -> None:
    unknown = sorted(set(kwargs) - set(known))
    if unknown:
        raise ValueError(f"call {method}(): unknown worker(s) {unknown}; started: {sorted(known)}")


class FailurePolicy:
    """The ``on_failure`` decision shared by every executor kind (see the module docstring)."""

    def __init__(self, alloc: AllocationConfig) -> None:
        self.mode = alloc.on_failure
        self.max_restarts = alloc.max_restarts
        self.restarts: dict[str, int] = {}
        self.removed: dict[str, WorkerFailure] = {}

    def unavailable(self, worker: str, method: str) -> CallResult:
        why = self.removed[worker]
        return CallResult(worker, failure=WorkerFailure(
            worker=worker, method=method, exc_type="WorkerRemoved", traceback=why.traceback,
            message=f"removed after {why.kind} in {why.method}(): {why.message}", kind="unavailable"))

    def apply(self, results: dict[str, CallResult], restart: Callable[[str], None],
              remove: Callable[[str], None]) -> None:
        failures = [r.failure for r in results.values()
                    if r.failure is not None and r.failure.kind != "unavailable"]
        fatal = []
        for f in failures:
            if self.mode == "restart" and self.restarts.get(f.worker, 0) < self.max_restarts:
                self.restarts[f.worker] = self.restarts.get(f.worker, 0) + 1
                try:
                    restart(f.worker)
                    continue
                except Exception as exc:  # a failed rebuild is a failure of its own
                    fatal.append(failure_from_exception(f.worker, "restart", exc))
            if self.mode == "continue":
                self.removed[f.worker] = f
                remove(f.worker)
            else:
                fatal.append(f)
        if fatal:
            raise WorkerFailedError(fatal, results)


def build_worker(factory: Callable[[], object], restarted: bool) -> object:
    obj = factory()
    if restarted and callable(getattr(obj, "load_checkpoint", None)):
        obj.load_checkpoint()
    return obj


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
        self.policy = FailurePolicy(self.alloc)
        self._factories: dict[str, Callable[[], object]] = {}
        self._workers: dict[str, object] = {}
        self._threads: dict[str, _WorkerThread] = {}
        self._planned_threads: dict[str, int] = {}

    def start(self, factories: dict[str, Callable[[], object]], plan: Plan | None = None) -> None:
        self._factories = dict(factories)
        if plan is not None:
            self._planned_threads = {a.worker: a.threads for a in plan.assignments
                                     if a.worker in factories}
            shares = [t for t in self._planned_threads.values() if t > 0]
            if self.mode == "threads" and shares:
                _set_torch_threads(min(shares))
        results = self._run({n: (lambda n=n: self._build(n, False)) for n in factories},
                            "__init__", self.alloc.call_timeout_s)
        failures = [r.failure for r in results.values() if r.failure is not None]
        if failures:
            self.shutdown()
            raise WorkerFailedError(failures, results)

    def _build(self, name: str, restarted: bool) -> None:
        self._workers[name] = build_worker(self._factories[name], restarted)

    def put(self, obj: Any) -> Any:
        return obj  # in process nothing is copied: the object itself is the reference

    def live_workers(self) -> list[str]:
        return [n for n in self._factories if n not in self.policy.removed]

    def worker(self, name: str) -> object:
        """The object a worker runs (in process). A restart replaces it: read it again after one."""
        return self._workers[name]

    def call(self, method: str, kwargs: dict[str, dict], timeout_s: float | None = None, *,
             fetch: bool = True) -> dict[str, CallResult]:
        check_names(method, kwargs, self._factories)
        live = {n: kw for n, kw in kwargs.items() if n not in self.policy.removed}
        jobs = {n: (lambda n=n, kw=kw: self._invoke(n, method, kw)) for n, kw in live.items()}
        results = self._run(jobs, method, timeout_s or self.alloc.call_timeout_s)
        for n in kwargs:
            if n not in live:
                results[n] = self.policy.unavailable(n, method)
        self.policy.apply(results, self._restart, self._remove)
        return {n: results[n] for n in kwargs}

    def _invoke(self, name: str, method: str, kw: dict) -> Any:
        if self.mode == "sequential" and self._planned_threads.get(name):
            _set_torch_threads(self._planned_threads[name])
        try:
            fn = getattr(self._workers[name], method)
        except AttributeError:
            raise AttributeError(f"worker {name!r} ({type(self._workers[name]).__name__}) has no "
                                 f"method {method!r}") from None
        return fn(**kw)

    def _run(self, jobs: dict[str, Callable[[], Any]], method: str,
             timeout_s: float) -> dict[str, CallResult]:
        if self.mode == "sequential":
            return {n: self._outcome(n, method, _done_future(job)) for n, job in jobs.items()}
        for n in jobs:
            if n not in self._threads:
                self._threads[n] = _WorkerThread(n)
        futures = {n: self._threads[n].submit(job) for n, job in jobs.items()}
        wait_futures(list(futures.values()), timeout=timeout_s)
        return {n: self._outcome(n, method, fut, timeout_s) for n, fut in futures.items()}

    def _outcome(self, name: str, method: str, fut: Future, timeout_s: float = 0.0) -> CallResult:
        if not fut.done():
            where = self._threads[name].stack()
            return CallResult(name, failure=WorkerFailure(
                worker=name, method=method, exc_type="TimeoutError", kind="timeout",
                message=f"no result within {timeout_s:g} s; its thread is abandoned",
                traceback=f"where it was when abandoned:\n{where}"))
        try:
            return CallResult(name, value=fut.result(timeout=0))
        except KeyboardInterrupt:
            raise
        except (FutureTimeout, BaseException) as exc:  # SystemExit in a worker is a failure too
            return CallResult(name, failure=failure_from_exception(name, method, exc))

    def _abandon(self, name: str) -> None:
        # A hung thread cannot be killed; it is daemonic and unreferenced, so it dies with us.
        t = self._threads.pop(name, None)
        if t is not None:
            t.close()

    def _restart(self, name: str) -> None:
        self._abandon(name)
        self._workers.pop(name, None)
        res = self._run({name: lambda: self._build(name, True)}, "restart", self.alloc.call_timeout_s)
        if not res[name].ok:
            raise RuntimeError(f"restart of worker {name!r} failed: {res[name].failure}")

    def _remove(self, name: str) -> None:
        self._abandon(name)
        self._workers.pop(name, None)

    def shutdown(self) -> None:
        for name in list(self._threads):
            self._abandon(name)
        self._workers.clear()


def _done_future(job: Callable[[], Any]) -> Future:
    fut: Future = Future()
    try:
        fut.set_result(job())
    except Exception as exc:  # KeyboardInterrupt still reaches the user in sequential mode
        fut.set_exception(exc)
    return fut


def _make_ray(alloc: AllocationConfig) -> Executor:
    try:
        from mutualrl.allocation.ray_executor import RayExecutor
    except ImportError as exc:
        raise ImportError("executor 'ray' needs Ray: pip install 'mutualrl[ray]' "
                          f"(or: pip install 'ray>=2.40'); import failed: {exc}") from exc
    return RayExecutor(alloc)


EXECUTORS.register("local", LocalExecutor)
EXECUTORS.register("ray", _make_ray)
