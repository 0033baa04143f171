"""The workers a plan runs, and the executors that host them.

* ``make_executor(alloc)`` — ``local`` (threads or sequential, default), ``process`` or ``ray``
  executors (``kinds``), applying typed calls (``calls``: ``call_each``, ``call_live``,
  ``call_one``) to their workers, with the same books (``roster``) and failure policy on every
  kind. A worker that is a rank group runs as one process per rank (``ranks``).

The Ray executor lives in ``ray_executor`` and is imported only when asked for (extra ``ray``).
"""

from mutualrl.workers.calls import (
    CallResult,
    Executor,
    WorkerCall,
    WorkerFailedError,
    WorkerFailure,
    WorkerUnavailable,
    call_each,
    call_live,
    call_one,
)
from mutualrl.workers.executors import LocalExecutor
from mutualrl.workers.kinds import EXECUTORS, make_executor
from mutualrl.workers.processes import ProcessExecutor

__all__ = [
    "EXECUTORS",
    "CallResult",
    "Executor",
    "LocalExecutor",
    "ProcessExecutor",
    "WorkerCall",
    "WorkerFailedError",
    "WorkerFailure",
    "WorkerUnavailable",
    "call_each",
    "call_live",
    "call_one",
    "make_executor",
]
