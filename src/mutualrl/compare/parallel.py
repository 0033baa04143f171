"""``compare --jobs N``: runs in worker processes, which stop with their parent.

A worker is a spawned process of a ``ProcessPoolExecutor``. Each watches its parent: when the
compare dies (``kill -9`` included), the worker sends itself SIGTERM, so its run stops at the next
step boundary with a checkpoint (``run.signals``) and the worker exits; it never trains on into a
folder nobody reads, nor blocks on a pipe to a dead parent. An interrupted compare (Ctrl-C,
SIGTERM) passes SIGTERM on to its workers the same way before it stops.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from mutualrl.malloc import reuse_large_buffers
from mutualrl.run.progress import RunProgress

# How often a worker looks for its parent, and how long it then gives its run to stop at a step
# boundary before it exits regardless.
PARENT_POLL_S = 1.0
STOP_GRACE_S = 120.0
PARENT_ENV = "MUTUALRL_COMPARE_PARENT"


def watch_parent(parent: int) -> None:
    """Worker initializer: a daemon thread that stops this worker once ``parent`` is gone (and
    the allocator set up as in every mutualrl process)."""
    reuse_large_buffers()
    os.environ[PARENT_ENV] = str(parent)
    threading.Thread(
        target=_watch, args=(parent,), name="mutualrl-parent-watch", daemon=True
    ).start()


def _orphaned() -> bool:
    parent = os.environ.get(PARENT_ENV)
    return parent is not None and os.getppid() != int(parent)


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os.kill(os.getpid(), signal.SIGTERM)  # the run stops at its next step boundary
    time.sleep(STOP_GRACE_S)
    os._exit(128 + signal.SIGTERM)


def stop_workers(pool) -> None:
    """SIGTERM to every live worker of ``pool``: each run stops at a step boundary."""
    for proc in list(getattr(pool, "_processes", {}).values()):
        if proc.is_alive():
            try:
                os.kill(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


def _train_in_process(train_fn: Callable, cfg, resume: bool):
    """One run in a worker process of ``--jobs``: no display of its own (the compare shows it).
    A worker whose compare died exits as soon as its run has stopped: nobody reads its result,
    and the pool's queues (whose ends every worker holds) would keep it waiting for ever."""
    progress = RunProgress(enabled=False)
    try:
        return train_fn(cfg, progress, resume=True) if resume else train_fn(cfg, progress)
    finally:
        if _orphaned():
            os._exit(128 + signal.SIGTERM)


def run_parallel(runner, todo: list, jobs: int) -> None:
    """``jobs`` runs at a time in worker processes. A seed's first run starts before the
    seed's others, which wait until it has finished (and so stored the warm start they load).
    After a failure no new run starts; those running finish, then the first error is raised."""
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    leaders: dict[int, Any] = {}  # seed -> its first run
    for r in todo:
        leaders.setdefault(r.seed, r)
    pending = list(leaders.values()) + [r for r in todo if leaders[r.seed] is not r]
    warmed: set[int] = set()
    running: dict = {}
    error: BaseException | None = None
    # Workers are reused, as one process runs every run of a sequential compare: their tokenizer
    # and THL byte-table caches then serve several runs (building them costs seconds per run).
    with ProcessPoolExecutor(
        max_workers=jobs,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=watch_parent,
        initargs=(os.getpid(),),
    ) as pool:
        try:
            while running or (pending and error is None):
                while error is None and len(running) < jobs:
                    r = next((r for r in pending if r.seed in warmed or leaders[r.seed] is r), None)
                    if r is None:
                        break
                    pending.remove(r)
                    resume = runner.begin(r)
                    runner.progress.run_started(r.name)
                    running[pool.submit(_train_in_process, runner.train_fn, r.cfg, resume)] = r
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
                for fut in finished:
                    r = running.pop(fut)
                    try:
                        summary = fut.result()
                    except Exception as exc:
                        runner.failed(r, exc)
                        error = error or exc
                        continue
                    warmed.add(r.seed)
                    runner.done(r, summary)
        except KeyboardInterrupt as exc:
            for r in running.values():
                runner.failed(r, exc)
            stop_workers(pool)  # their runs stop at a step boundary, with a checkpoint
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    if error is not None:
        raise error
