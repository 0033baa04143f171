"""Calls on the run's policy workers, through the executor, wherever the policies live.

Every call that touches a policy's weights goes through one of these. A worker whose call fails is
dealt with by the executor's ``on_failure`` policy (``stop`` raises; ``continue`` and ``restart``
keep the run going), so callers get either the values of the workers that succeeded or, for a
single worker, ``WorkerUnavailable``.
"""

from __future__ import annotations

from typing import Any


class WorkerUnavailable(RuntimeError):
    """A call to one worker failed and ``on_failure`` kept the run going (the worker was removed
    or rebuilt; under ``stop`` the executor raises ``WorkerFailedError`` instead)."""


def call_one(executor, name: str, method: str, **kwargs) -> Any:
    """One worker's ``method(**kwargs)``; its value, or ``WorkerUnavailable``."""
    result = executor.call(method, {name: kwargs})[name]
    if not result.ok:
        raise WorkerUnavailable(str(result.failure))
    return result.value


def call_each(executor, method: str, kwargs: dict[str, dict]) -> dict[str, Any]:
    """``method`` on each named worker with its own keyword arguments, all at once; the values of
    those that succeeded (a worker missing from the result failed)."""
    results = executor.call(method, kwargs)
    return {n: r.value for n, r in results.items() if r.ok}


def call_live(executor, method: str, **kwargs) -> dict[str, Any]:
    """``method(**kwargs)`` on every live worker at once; the values of those that succeeded."""
    return call_each(executor, method, {n: kwargs for n in executor.live_workers()})
