"""Workers that run as a group of ranks: one process per rank, one ``torch.distributed`` group.

A ``RankGroup`` factory (a sharded policy learner, ``policies.sharded``) asks an executor for
``ranks`` processes instead of one. The executor starts them with the rendezvous in their
environment (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, and each
rank's own GPU in ``CUDA_VISIBLE_DEVICES``); in each, ``RankFactory`` forms the process group
(``join_group``) and then builds the rank's worker object. To the run the group is one worker:
every call goes to all its ranks (their collectives need every rank) and rank 0's answer is the
worker's (``merge_ranks``); a rank that raises, dies or hangs is that worker's failure, and the
other ranks, which would wait in a collective for it, are ended with it.

Forming the group is bounded: rank 0 listens on the rendezvous port and waits for every other
rank for ``allocation.process_group_timeout_s``; a port already in use, or a rank that never
arrives, is a ``ProcessGroupError`` naming the rank, the address and the cause, not a hang.
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mutualrl.workers.calls import CallResult, WorkerFailure

# After a rank of a group fails, how long the group's other ranks may still report before the
# group is killed: the rank whose death broke its peers' collectives may be seen after the errors
# it caused in them (through Ray, always later), and the failure should name it.
RANK_FAILURE_GRACE_S = 2.0


class ProcessGroupError(RuntimeError):
    """A rank group's process group could not form."""


@dataclass(frozen=True)
class RankContext:
    """What a rank's worker is built with, once its process group has formed."""

    rank: int
    world_size: int
    backend: str  # "gloo" (CPU) or "nccl" (CUDA)


@dataclass(frozen=True)
class RankGroup:
    """A worker factory for ``ranks`` processes in one process group: ``build`` (picklable) runs
    in each rank's process and returns that rank's worker object."""

    ranks: int
    build: Callable[[RankContext], object]
    backend: str = "gloo"

    def __call__(self) -> object:
        raise TypeError(
            f"a group of {self.ranks} ranks needs an executor that starts one process "
            'per rank (allocation.executor = "process" or "ray")'
        )


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free now (the group's rank 0 binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def rank_env(
    rank: int, world_size: int, addr: str, port: int, local_rank: int | None = None
) -> dict[str, str]:
    """The rendezvous environment of one rank (torch.distributed's names)."""
    local = rank if local_rank is None else local_rank
    return {
        "MASTER_ADDR": addr,
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(local),
        "LOCAL_WORLD_SIZE": str(world_size),
    }


def join_group(
    rank: int, world_size: int, backend: str, timeout_s: float, collective_timeout_s: float
) -> None:
    """Form the default process group from the environment's rendezvous, within ``timeout_s``.

    The store is made here rather than by ``init_process_group(init_method="env://")`` so that
    forming the group and each later collective have their own bounds: a group must form
    quickly, while a collective may wait for a slow peer as long as a call may take."""
    import torch.distributed as dist

    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    where = f"rank {rank} of {world_size} at {addr}:{port}"
    try:
        store = dist.TCPStore(
            addr,
            port,
            world_size,
            is_master=rank == 0,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=True,
        )
        if backend == "nccl":
            import torch

            torch.cuda.set_device(0)  # the rank's one visible GPU (CUDA_VISIBLE_DEVICES)
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=collective_timeout_s),
        )
    except Exception as exc:  # torch raises several store/network error types; name them all
        cause = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        hint = (
            "the port is in use (another group, or set allocation.master_port elsewhere)"
            if "in use" in str(exc).lower()
            else f"not every rank joined within {timeout_s:g} s "
            "(allocation.process_group_timeout_s)"
        )
        raise ProcessGroupError(
            f"{where}: the process group could not form: {hint} ({cause})"
        ) from None


@dataclass(frozen=True)
class RankFactory:
    """What one rank's process runs: join the group, then build the rank's worker."""

    group: RankGroup
    rank: int
    timeout_s: float  # to form the group
    collective_timeout_s: float  # each collective afterwards

    def __call__(self) -> object:
        join_group(
            self.rank,
            self.group.ranks,
            self.group.backend,
            self.timeout_s,
            self.collective_timeout_s,
        )
        return self.group.build(RankContext(self.rank, self.group.ranks, self.group.backend))


def merge_ranks(name: str, method: str, results: list[CallResult]) -> CallResult:
    """One worker's result from its ranks' results (in rank order): rank 0's value when every
    rank succeeded, else a failure naming every failed rank with its message (the first one's
    type and traceback). When a rank dies, the others' collectives fail too, and the first to
    report need not be the cause."""
    failed = [(rank, r.failure) for rank, r in enumerate(results) if r.failure is not None]
    if not failed:
        return CallResult(name, value=results[0].value)
    f = failed[0][1]
    return CallResult(
        name,
        failure=WorkerFailure(
            worker=name,
            method=method,
            exc_type=f.exc_type,
            kind=f.kind,
            traceback=f.traceback,
            message="; ".join(f"rank {rank} of {len(results)}: {x.message}" for rank, x in failed),
        ),
    )


def group_size(factory: Any) -> int:
    """Processes a worker factory asks for: a ``RankGroup``'s ranks, else 1."""
    return factory.ranks if isinstance(factory, RankGroup) else 1
