"""``allocation.on_failure = "restart"`` in ``mutualrl train``: the run goes back to its last
checkpoint, every worker rebuilt, and trains on from there.

Rebuilding only the worker that failed, from its factory, would bring its policy back with the
weights it started with (no warm start, no update since) while the run went on as if nothing had
happened. A policy's state lives in the run's checkpoints, next to everything else its future
depends on (the other policies, the exchange log, the strategy's buffers, the RNGs), and they
are consistent only together. So a restart is what ``mutualrl train --resume`` does, in the same
process and under the same folder lock: the failed attempt is closed (its workers stopped, its
files flushed), the run's files are cut back to the last complete checkpoint (what follows is
moved aside, as a resume moves it), a new run is built from the config, and the checkpoint is
loaded into it. A transient failure (a worker killed by the OOM killer, a lost device) therefore
costs the steps since that checkpoint, and the run's records equal an uninterrupted run's. This
is TorchElastic's rule: any worker fails, every worker restarts from the last checkpoint.

A restarting run writes a checkpoint after its warm start (step 0), so there is always one to go
back to once training begins; ``save_steps`` must be >= 1 (``RunConfig`` refuses 0). A failure
before that checkpoint (building the workers, the warm start) stops the run, as does a policy's
``max_restarts + 1``-th failure. Each restart is said on stderr, appended to
``RUN_DIR/failures.jsonl`` with the worker's traceback, and logged in ``metrics.jsonl`` as a
``"restart"`` record. A paced run (``max_staleness >= 1``) refuses ``restart`` (``RunConfig``).

The executor itself is told ``stop``: the run, not the executor, rebuilds.
"""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec

from mutualrl.config import AllocationConfig, RunConfig
from mutualrl.run import checkpoint
from mutualrl.run.departures import FILE
from mutualrl.workers.calls import WorkerFailedError, WorkerFailure


class Restart(msgspec.Struct, frozen=True, kw_only=True):
    """One restart of the run: the policy whose worker failed, the failure, and the checkpoint
    the run went back to."""

    policy: str
    restart: int  # this policy's restarts so far, this one included
    max_restarts: int
    checkpoint_step: int  # the run continues after this step
    failure: WorkerFailure

    def line(self, out: Path) -> str:
        f = self.failure
        return (
            f"mutualrl: policy {self.policy!r} failed: {f.method}(): {f.kind}: {f.exc_type}: "
            f"{f.message}; restarting the run from its checkpoint after step "
            f"{self.checkpoint_step} (restart {self.restart} of {self.max_restarts} for this "
            f'policy, allocation.on_failure = "restart"); traceback in {out / FILE}'
        )


def executor_allocation(alloc: AllocationConfig) -> AllocationConfig:
    """The allocation the run's executor works under: under ``restart`` it stops at a failure
    and the run restarts (see the module docstring)."""
    if alloc.on_failure != "restart":
        return alloc
    return msgspec.structs.replace(alloc, on_failure="stop")


def checkpoint_at_start(cfg: RunConfig) -> bool:
    """Whether the run checkpoints after its warm start: so that a restart has a checkpoint to
    go back to from the first step on."""
    return cfg.allocation.on_failure == "restart" and cfg.save_steps >= 1


class Restarts:
    """The restarts one ``mutualrl train`` has taken, per policy (see the module docstring)."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.out = Path(cfg.output_dir)
        self.counts: dict[str, int] = {}

    def take(self, exc: WorkerFailedError) -> checkpoint.Checkpoint:
        """Record a restart for the failure ``exc`` and return the checkpoint to go back to (found
        and verified); or raise ``exc`` when the run may not restart: ``on_failure`` is not
        ``restart``, a failed policy has used its ``max_restarts``, or there is no complete
        checkpoint."""
        alloc = self.cfg.allocation
        if alloc.on_failure != "restart" or not exc.failures:
            raise exc
        spent = [
            f.worker for f in exc.failures if self.counts.get(f.worker, 0) >= alloc.max_restarts
        ]
        if spent:
            self._say(
                f"policies {sorted(set(spent))} have failed again after "
                f"{alloc.max_restarts} restart(s) (allocation.max_restarts); stopping"
            )
            raise exc
        notes: list[str] = []
        ckpt = checkpoint.latest(self.out, report=notes.append)
        for note in notes:
            self._say(note)
        if ckpt is None:
            self._say(
                "a worker failed before the run's first checkpoint (written after the warm "
                'start under allocation.on_failure = "restart"), so there is nothing to '
                "restart from; stopping"
            )
            raise exc
        for f in exc.failures:
            self.counts[f.worker] = self.counts.get(f.worker, 0) + 1
            record = Restart(
                policy=f.worker,
                restart=self.counts[f.worker],
                max_restarts=alloc.max_restarts,
                checkpoint_step=ckpt.step,
                failure=f,
            )
            with (self.out / FILE).open("ab") as fh:
                fh.write(msgspec.json.encode(record) + b"\n")
            print(record.line(self.out), file=sys.stderr, flush=True)
        return ckpt

    @staticmethod
    def _say(line: str) -> None:
        print(f"mutualrl: {line}", file=sys.stderr, flush=True)

    def record(self, opened: dict) -> dict:
        """The ``metrics.jsonl`` record of the resume that a restart makes: the resume's, as
        phase ``"restart"``, with the restarts so far."""
        return {**opened, "phase": "restart", "restarts": dict(self.counts)}
