"""Executor kinds, a registry: ``local`` (this process, the default), ``process`` (one process per
worker on this machine) and ``ray`` (extra ``ray``).

Apart from the executors themselves, so that neither imports the other: the Ray executor is
imported only when asked for.
"""

from __future__ import annotations

from collections.abc import Callable

from mutualrl.config import AllocationConfig
from mutualrl.registry import Registry
from mutualrl.workers.calls import Executor
from mutualrl.workers.executors import LocalExecutor
from mutualrl.workers.processes import ProcessExecutor

EXECUTORS: Registry[Callable[[AllocationConfig], Executor]] = Registry("executor kind")


def make_executor(alloc: AllocationConfig) -> Executor:
    return EXECUTORS.get(alloc.executor)(alloc)


def _make_ray(alloc: AllocationConfig) -> Executor:
    try:
        from mutualrl.workers.ray_executor import RayExecutor
    except ImportError as exc:
        raise ImportError(
            "executor 'ray' needs Ray: pip install 'mutualrl[ray]' "
            f"(or: pip install 'ray>=2.40'); import failed: {exc}"
        ) from exc
    return RayExecutor(alloc)


EXECUTORS.register("local", LocalExecutor)
EXECUTORS.register("process", ProcessExecutor)
EXECUTORS.register("ray", _make_ray)
