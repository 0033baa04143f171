"""What a worker's host answers, and one call's answers gathered from every rank of its workers.

A host in a process of its own (the process executor's worker process, a Ray actor) answers a
call with a status tuple: ``("ok", ...)``, or ``raised_status(exc)``, ``("raised", exc_type,
message, traceback, ...)``; either ends with the seconds the call took in the host (the worker's
busy time). ``raised_failure`` reads the second back into a failure of the worker.

``RankReplies`` waits for one reply per rank (a worker that is not a rank group has one rank)
within one deadline. A rank that fails ends its group's other ranks at once, since they would wait
in a collective for it; a rank with no reply by the deadline is its worker's timeout, and its
worker's hosts are killed. Each executor kind says how it waits on its hosts (pipes, object refs),
reads a reply and kills a worker's hosts.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from mutualrl.workers.calls import CallResult, FailureKind, WorkerFailure
from mutualrl.workers.ranks import RANK_FAILURE_GRACE_S, merge_ranks


def failure_result(
    name: str,
    method: str,
    exc_type: str,
    message: str,
    *,
    kind: FailureKind = "raised",
    traceback: str = "",
) -> CallResult:
    """Worker ``name``'s failed result for ``method``."""
    return CallResult(
        name,
        failure=WorkerFailure(
            worker=name,
            method=method,
            exc_type=exc_type,
            message=message,
            traceback=traceback,
            kind=kind,
        ),
    )


def raised_status(exc: BaseException, seconds: float = 0.0) -> tuple[str, str, str, str, float]:
    """A host's answer to a call that raised ``exc`` after ``seconds``."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return ("raised", type(exc).__name__, str(exc), tb, seconds)


def raised_failure(name: str, method: str, status: Sequence[Any]) -> CallResult:
    """Worker ``name``'s failure from its host's ``raised_status``."""
    _, exc_type, message, tb, _ = status
    return failure_result(name, method, exc_type, message, traceback=tb)


# Those of the handles whose replies are in, waiting at most the seconds given for one of them.
Ready = Callable[[list[Any], float], list[Any]]
# Worker ``name``'s reply from ``rank``; ``late`` once another rank of its group has failed.
Receive = Callable[[str, int, bool], CallResult]


class RankReplies:
    """One call's replies as they come in, per worker one slot per rank (``handles[name]``, in
    rank order), gathered within ``timeout_s`` by ``results()``. ``ready`` and ``receive`` wait
    on and read the executor's hosts; ``kill(name)`` ends a worker's hosts; ``hung`` ends a
    timeout's message with what became of them."""

    def __init__(
        self,
        handles: dict[str, list[Any]],
        method: str,
        timeout_s: float,
        *,
        ready: Ready,
        receive: Receive,
        kill: Callable[[str], None],
        hung: str,
    ) -> None:
        self.method, self.timeout_s, self.hung = method, timeout_s, hung
        self.ready, self.receive, self.kill = ready, receive, kill
        self.deadline = time.monotonic() + timeout_s
        self.pending = {h: (n, r) for n, per in handles.items() for r, h in enumerate(per)}
        self.replies: dict[str, list[CallResult | None]] = {
            n: [None] * len(per) for n, per in handles.items()
        }
        self.failed: dict[str, CallResult] = {}

    def results(self) -> dict[str, CallResult]:
        """Every worker's result: rank 0's value, or the failure of its ranks (``merge_ranks``),
        or its timeout."""
        while self.pending and (left := self.deadline - time.monotonic()) > 0:
            for handle in self.ready(list(self.pending), left):
                if handle in self.pending:  # not a rank of a group that failed meanwhile
                    self._reply(*self.pending.pop(handle))
        for name, rank in self.pending.values():
            if name not in self.failed:
                self._time_out(name, rank)
        return {
            n: self.failed.get(n) or merge_ranks(n, self.method, [x or CallResult(n) for x in per])
            for n, per in self.replies.items()
        }

    def _reply(self, name: str, rank: int) -> None:
        reply = self.replies[name][rank] = self.receive(name, rank, False)
        if not reply.ok and len(self.replies[name]) > 1 and name not in self.failed:
            self._fail_group(name)

    def _fail_group(self, name: str) -> None:
        """After a group's first failed rank, its other ranks' replies for a moment: the rank
        whose death broke the others' collectives may report after them (a dead process's pipe
        and a peer's broken socket close at once; through Ray, always later), and the failure
        should name it. Then the group's hosts are killed."""
        until = min(time.monotonic() + RANK_FAILURE_GRACE_S, self.deadline)
        rest = {h: r for h, (n, r) in self.pending.items() if n == name}
        while rest and (left := until - time.monotonic()) > 0:
            for handle in self.ready(list(rest), left):
                rank = rest.pop(handle)
                self.replies[name][rank] = self.receive(name, rank, True)
        replies = [x or CallResult(name) for x in self.replies[name]]
        self.failed[name] = merge_ranks(name, self.method, replies)
        self.pending = {h: w for h, w in self.pending.items() if w[0] != name}
        self.kill(name)

    def _time_out(self, name: str, rank: int) -> None:
        ranks = len(self.replies[name])
        where = f" from rank {rank} of {ranks}" if ranks > 1 else ""
        self.failed[name] = failure_result(
            name,
            self.method,
            "TimeoutError",
            f"no result within {self.timeout_s:g} s{where}{self.hung}",
            kind="timeout",
        )
        self.kill(name)
