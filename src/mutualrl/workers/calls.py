"""Typed calls on workers, and what every executor kind reports back.

A worker is any Python object an executor built from a factory. What the run asks of it is a
*call*: a frozen dataclass whose fields are the arguments and whose ``__call__(worker)`` runs it
on the worker object, e.g. ``Generate(prompts, ...)(policy)`` is ``policy.generate(...)``. The same
call object goes to every executor kind: the local one applies it in its thread, the Ray one
sends its fields to the worker's actor (top-level ``ObjectRef`` fields are resolved there, from
the object store) and applies it in that process. No method names travel as strings, so a
renamed worker method breaks its call class (one place, found by reading), not a string.

Each call returns one ``CallResult`` per named worker: a value, or a ``WorkerFailure``
(``raised`` with the worker's traceback, ``timeout`` with the stack where it hangs when that can
be read, or ``unavailable`` for a worker removed earlier).

Failure policy (``[allocation] on_failure``), applied after all results of a call are in:

* ``stop``     — ``call`` raises ``WorkerFailedError`` carrying every result, so the loop can
  write what it has and stop cleanly;
* ``continue`` — the failed worker is removed; later calls report it ``unavailable``;
* ``restart`` is the run's, not an executor's: ``mutualrl train`` tells its executor ``stop``
  and restarts the whole run from its last checkpoint (``run.restarts``). Rebuilding one worker
  from its factory would bring its policy back without the state the rest of the run depends
  on, so an executor refuses ``restart``.

Under ``continue`` a worker that raised still answers, so every executor closes it
(``close_worker``) before it goes; a hung or dead one is killed without a close.
"""

from __future__ import annotations

import dataclasses
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

import msgspec

if TYPE_CHECKING:
    from mutualrl.config import AllocationConfig

FailureKind = Literal["raised", "timeout", "unavailable"]


class WorkerCall(Protocol):
    """A call on one worker: a dataclass of its arguments, applied to the worker object."""

    __dataclass_fields__: ClassVar[dict[str, Any]]  # a dataclass (``call_fields`` reads them)

    def __call__(self, worker: Any) -> Any: ...


def call_name(call: WorkerCall | str) -> str:
    """The call's name in reports and errors (its class name; executors' own steps are strings)."""
    return call if isinstance(call, str) else type(call).__name__


def call_fields(call: WorkerCall) -> dict[str, Any]:
    """The call's arguments, top level only (Ray resolves object refs among them in the actor)."""
    return {f.name: getattr(call, f.name) for f in dataclasses.fields(call)}


class WorkerFailure(msgspec.Struct, frozen=True, kw_only=True):
    worker: str
    method: str
    exc_type: str
    message: str
    traceback: str
    kind: FailureKind

    def __str__(self) -> str:
        return (
            f"worker {self.worker!r} {self.method}(): {self.kind}: {self.exc_type}: {self.message}"
        )


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


class WorkerUnavailable(RuntimeError):
    """A call to one worker failed and ``on_failure`` kept the run going (the worker was
    removed; under ``stop`` the executor raises ``WorkerFailedError`` instead)."""


class Executor(Protocol):
    def start(self, factories: dict[str, Callable[[], object]], plan: Any = None) -> None: ...

    def call(
        self, calls: dict[str, WorkerCall], timeout_s: float | None = None, *, fetch: bool = True
    ) -> dict[str, CallResult]: ...

    def put(self, obj: Any) -> Any: ...

    def live_workers(self) -> list[str]: ...

    def removed(self) -> dict[str, WorkerFailure]: ...

    def busy_seconds(self) -> dict[str, float]:
        """Seconds each worker has spent inside calls so far (the rest of a step it idled)."""
        ...

    def shutdown(self) -> None: ...


def failure_from_exception(worker: str, method: str, exc: BaseException) -> WorkerFailure:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return WorkerFailure(
        worker=worker,
        method=method,
        exc_type=type(exc).__name__,
        message=str(exc),
        traceback=tb,
        kind="raised",
    )


def check_names(method: str, calls: dict[str, Any], known: dict) -> None:
    unknown = sorted(set(calls) - set(known))
    if unknown:
        raise ValueError(f"call {method}(): unknown worker(s) {unknown}; started: {sorted(known)}")


def close_worker(name: str, obj: object) -> None:
    """The worker's ``close()``, where it has one, once the run is done with it (a policy's
    vLLM engine removes its scratch folder). A failure to close is a warning naming the worker:
    the run's own outcome stands."""
    close = getattr(obj, "close", None)
    if not callable(close):
        return
    try:
        close()
    except Exception as exc:
        warnings.warn(
            f"worker {name!r}: close() failed ({type(exc).__name__}: {exc})",
            RuntimeWarning,
            stacklevel=2,
        )


class FailurePolicy:
    """The ``on_failure`` decision shared by every executor kind (see the module docstring)."""

    def __init__(self, alloc: AllocationConfig) -> None:
        if alloc.on_failure == "restart":
            raise ValueError(
                'allocation.on_failure = "restart" is the run\'s: mutualrl train restarts the '
                'whole run from its last checkpoint (run.restarts) and gives its executor "stop"; '
                'an executor takes "stop" or "continue"'
            )
        self.mode = alloc.on_failure
        self.removed: dict[str, WorkerFailure] = {}

    def unavailable(self, worker: str, method: str) -> CallResult:
        why = self.removed[worker]
        return CallResult(
            worker,
            failure=WorkerFailure(
                worker=worker,
                method=method,
                exc_type="WorkerRemoved",
                traceback=why.traceback,
                message=f"removed after {why.kind} in {why.method}(): {why.message}",
                kind="unavailable",
            ),
        )

    def apply(self, results: dict[str, CallResult], remove: Callable[[str], None]) -> None:
        failures = [
            r.failure
            for r in results.values()
            if r.failure is not None and r.failure.kind != "unavailable"
        ]
        if self.mode == "continue":
            for f in failures:
                self.removed[f.worker] = f
                remove(f.worker)
        elif failures:
            raise WorkerFailedError(failures, results)


# ---- the run's side: values of the workers that succeeded ------------------------------------
def call_one(executor: Executor, name: str, call: WorkerCall) -> Any:
    """One worker's ``call``; its value, or ``WorkerUnavailable``."""
    result = executor.call({name: call})[name]
    if not result.ok:
        raise WorkerUnavailable(str(result.failure))
    return result.value


def call_each(executor: Executor, calls: dict[str, WorkerCall]) -> dict[str, Any]:
    """Each named worker's own call, all at once; the values of those that succeeded (a worker
    missing from the result failed, and ``on_failure`` has dealt with it)."""
    results = executor.call(calls)
    return {n: r.value for n, r in results.items() if r.ok}


def call_live(executor: Executor, call: WorkerCall) -> dict[str, Any]:
    """The same call on every live worker at once; the values of those that succeeded."""
    return call_each(executor, {n: call for n in executor.live_workers()})
