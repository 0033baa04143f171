"""Policies that left a run under ``allocation.on_failure = "continue"``: said, kept, never silent.

Under ``continue`` a worker whose call fails is removed and the other policies go on
(``workers.calls``). The run says so once, on stderr, when it first sees a policy gone (which
policy, at which step, the call and the error), appends the record with the worker's traceback
to ``RUN_DIR/failures.jsonl``, and ``summary.json`` names it under ``failed``. A run left with no
live policy has nothing to train: it stops with ``WorkerFailedError`` carrying every failure,
rather than finishing with empty steps and NaN evaluations.

The loop calls ``check`` after each phase that may lose a policy: the warm start and the first
evaluation, each lock-step step, each paced segment, the final evaluation.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Protocol

import msgspec

from mutualrl.workers.calls import Executor, WorkerFailedError, WorkerFailure


class RunMembers(Protocol):
    """What ``Departures.check`` reads of the run (``run.state.Run``, which holds the
    ``Departures``): its policies, those still in it, and the workers its executor removed."""

    @property
    def policies(self) -> Mapping[str, object]: ...

    @property
    def executor(self) -> Executor: ...

    def live(self) -> list[str]: ...


FILE = "failures.jsonl"


class Departure(msgspec.Struct, frozen=True, kw_only=True):
    """One policy's leaving: where in the run, and the failure that removed it."""

    policy: str
    step: int  # the step boundary where the run saw it gone (paced: its segment's end)
    phase: str  # "train", "warm start", "eval"
    failure: WorkerFailure

    def line(self, out: Path) -> str:
        f = self.failure
        return (
            f"mutualrl: policy {self.policy!r} left the run ({self.phase}, step {self.step}): "
            f"{f.method}(): {f.kind}: {f.exc_type}: {f.message}; the others go on "
            f'(allocation.on_failure = "continue"); traceback in {out / FILE}'
        )


class Departures:
    """The run's record of the policies that left it (see the module docstring)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.seen: dict[str, Departure] = {}

    def check(
        self,
        run: RunMembers,
        step: int,
        phase: str,
        failures: Iterable[WorkerFailure] = (),
        gone: Iterable[str] = (),
    ) -> None:
        """Record the policies newly gone: those the executor removed, and ``gone`` (a paced
        run's failed loops, whose ``failures`` say why). Raises when none is left."""
        removed = run.executor.removed()
        given = {f.worker: f for f in failures}
        live = set(run.live()) - set(gone)
        for name in run.policies:
            if name in live or name in self.seen:
                continue
            failure = removed.get(name) or given.get(name)
            if failure is None:  # gone before this process (a resumed paced run's books)
                continue
            d = Departure(policy=name, step=step, phase=phase, failure=failure)
            self.seen[name] = d
            with (self.out / FILE).open("ab") as fh:
                fh.write(msgspec.json.encode(d) + b"\n")
            print(d.line(self.out), file=sys.stderr, flush=True)
        if not live:
            raise WorkerFailedError(
                [d.failure for d in self.seen.values()] or list(given.values()), {}
            )

    def state_dict(self) -> dict[str, dict]:
        """The policies that have left, for a checkpoint: a resumed run does not start them again
        (``build_run``) and still names them in its summary."""
        return {n: msgspec.to_builtins(d) for n, d in self.seen.items()}

    def load_state_dict(self, state: dict[str, dict]) -> None:
        self.seen.update({n: msgspec.convert(d, Departure) for n, d in state.items()})

    def summary(self) -> dict[str, dict]:
        """Per policy that left: its step, phase, call and error (``summary.json``'s ``failed``)."""
        return {
            n: {
                "step": d.step,
                "phase": d.phase,
                "call": d.failure.method,
                "error": f"{d.failure.exc_type}: {d.failure.message}",
            }
            for n, d in sorted(self.seen.items())
        }
