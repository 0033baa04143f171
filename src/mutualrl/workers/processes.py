"""The process executor: one process per worker on this machine (executor kind ``process``).

Each worker is built inside a process of its own (started with ``spawn``), from the same
picklable factory the Ray executor sends to its actors, and typed calls (``workers.calls``)
travel to it through a pipe. What a process of its own gives that the threads of
``LocalExecutor`` cannot:

- **Isolation.** Libraries that keep process-global state — a vLLM engine's current config,
  forward context, sleep-mode allocator and ``torch.distributed`` group; ``torch.set_num_threads``
  — hold one copy per worker. Two vLLM policies need this (``run.build`` refuses them on the
  local executor).
- **Exact CPU shares.** Each process sets its planned thread count (``OMP_NUM_THREADS`` before
  torch starts its pool, then ``torch.set_num_threads``), while all workers run at once.
- **Planned devices.** ``CUDA_VISIBLE_DEVICES`` holds the worker's planned GPUs, so it computes
  on ``cuda:0`` of its own view (as under Ray), and an engine inside lands where the plan put it.
- **Hung workers are killed**, not abandoned: a call with no result within its timeout ends the
  process; ``on_failure`` then applies as for every executor. A
  worker process that dies (a segfault, the OOM killer, ``os._exit``) is reported as that
  worker's failure with its exit code.

- **Rank groups.** A ``RankGroup`` factory (a policy whose learner is sharded over several
  ranks) gets one process per rank, each with the group's rendezvous and its own planned GPU in
  its environment (``workers.ranks``); calls go to every rank, rank 0 answers, and a rank that
  fails ends the whole group as that worker's failure.

Worker processes are not daemonic (a daemonic process may not start children, and vLLM's CPU
build starts some); each watches its parent instead and exits when orphaned, so a killed run
leaves nothing behind.

**Each worker leads a process group of its own**, which holds whatever it starts: a vLLM engine
in a process of its own (a sharded learner's rank 0, ``policies.generation.vllm_engine``) lives
there, and vLLM's own exit handlers never run in a worker (a ``multiprocessing`` child ends
without them). A worker that returns ends what it started and reaps it (``_end_children``);
stopping a worker then ends its whole group (SIGTERM, then SIGKILL what remains), and a killed or
hung worker's group is killed at once. A SIGKILL to the driver's group reaches the driver only:
each worker's guard, a process in its group blocked on a pipe only the driver holds open, sees
the pipe close and kills the group at once (``_guard_group``). A Ctrl-C at the terminal reaches
the driver only, which finishes the step in flight (``run.signals``) and then stops the workers;
before, it reached every worker too and failed the step under way.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

from mutualrl.config import AllocationConfig
from mutualrl.malloc import reuse_large_buffers
from mutualrl.workers.calls import (
    CallResult,
    WorkerCall,
    WorkerFailure,
    close_worker,
)
from mutualrl.workers.ending import end_group, sweep_left_scratch
from mutualrl.workers.ranks import RankGroup, free_port, group_size, rank_env
from mutualrl.workers.replies import (
    RankReplies,
    failure_result,
    raised_failure,
    raised_status,
)
from mutualrl.workers.roster import (
    Roster,
    check_built,
    check_rank_gpus,
    rank_threads,
)

if TYPE_CHECKING:
    from mutualrl.allocation.planner import Plan

_EXIT_GRACE_S = 5.0


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(0.1)
        if os.getppid() != parent:
            if os.getpgrp() == os.getpid():  # this worker's own group: itself and its children
                os.killpg(0, signal.SIGKILL)
            os._exit(3)


def _guard_group(lifeline: Connection, conn: Connection) -> int:
    """Fork this worker's guard and return its pid. The guard is a process in the worker's group
    that blocks on ``lifeline``, whose other end only the driver holds. When the driver ends,
    however it ends (a SIGKILL too), the pipe reaches EOF and the guard kills the whole group at
    once. In a process of its own, no busy thread of the worker can delay it. Call it while the
    worker has one thread."""
    pid = os.fork()
    if pid:
        return pid
    try:  # the guard
        conn.close()  # only the worker answers the driver
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        while os.read(lifeline.fileno(), 1):
            pass
        os.killpg(0, signal.SIGKILL)
    finally:
        os._exit(0)


def _end_children(grace_s: float) -> None:
    """Before a worker returns: SIGTERM what it started (a vLLM engine in a process of its own),
    wait for it, SIGKILL what is left. Reaped here, none of them lingers as a zombie."""
    children = mp.active_children()
    for child in children:
        child.terminate()
    deadline = time.monotonic() + grace_s
    for child in children:
        child.join(max(0.0, deadline - time.monotonic()))
        if child.is_alive():
            child.kill()
            child.join()


def _serve(
    conn: Connection,
    lifeline: Connection,
    factory: bytes,
    env: dict[str, str],
    threads: int,
    parent: int,
) -> None:
    """The worker process: a group of its own with its guard, then its environment, then build
    the worker and answer calls until told to stop (``None``) or the driver goes away."""
    os.setpgrp()  # a process group of its own, for what it starts (see the module docstring)
    guard = _guard_group(lifeline, conn)
    try:
        _answer(conn, factory, env, threads, parent)
    finally:
        _end_children(_EXIT_GRACE_S)
        os.kill(guard, signal.SIGKILL)
        os.waitpid(guard, 0)


def _answer(
    conn: Connection,
    factory: bytes,
    env: dict[str, str],
    threads: int,
    parent: int,
) -> None:
    os.environ.update(env)
    reuse_large_buffers()
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    try:
        if threads > 0:
            import torch

            torch.set_num_threads(threads)
        obj = pickle.loads(factory)()
        conn.send(("ok", None, 0.0))
    except BaseException as exc:
        conn.send(raised_status(exc))
        return
    try:
        _calls(conn, obj)
    finally:  # told to stop, the driver gone, or a broken pipe
        close_worker(mp.current_process().name.removeprefix("mutualrl-"), obj)


def _calls(conn: Connection, obj: object) -> None:
    while True:
        try:
            call = conn.recv()
        except (EOFError, OSError):
            return
        if call is None:
            return
        t0 = time.perf_counter()
        reply: tuple
        try:
            value = call(obj)
            reply = ("ok", value, time.perf_counter() - t0)
        except BaseException as exc:  # reported to the driver, never swallowed
            reply = raised_status(exc, time.perf_counter() - t0)
        try:
            conn.send(reply)
        except Exception as exc:  # e.g. a value that cannot be pickled
            conn.send(raised_status(exc))


def worker_env(threads: int, gpus: tuple[int, ...] | None) -> dict[str, str]:
    """The environment a worker process starts with: its CPU threads and its planned GPUs."""
    env: dict[str, str] = {}
    if threads > 0:
        env["OMP_NUM_THREADS"] = str(threads)
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    return env


class _Proc:
    def __init__(
        self,
        name: str,
        factory: Callable[[], object],
        env: dict[str, str],
        threads: int,
    ) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        lifeline, self.lifeline = ctx.Pipe(duplex=False)  # the driver never writes to it
        self.process = ctx.Process(
            target=_serve,
            name=f"mutualrl-{name}",
            daemon=False,
            args=(child, lifeline, pickle.dumps(factory), env, threads, os.getpid()),
        )
        self.process.start()
        child.close()
        lifeline.close()
        self.asked = False

    def kill(self) -> None:
        """The worker and everything in its process group, at once."""
        end_group(self.process.pid, 0.0)
        if self.process.is_alive():  # not yet in a group of its own
            self.process.kill()
        self.process.join(_EXIT_GRACE_S)
        self.conn.close()
        self.lifeline.close()

    def ask_to_stop(self) -> None:
        if self.asked:
            return
        self.asked = True
        try:
            self.conn.send(None)
        except (OSError, ValueError):
            pass

    def stop(self) -> None:
        """Ask the worker to return and wait (it first ends what it started, for up to
        ``_EXIT_GRACE_S``), then end its group, then kill the rest."""
        self.ask_to_stop()
        self.process.join(2 * _EXIT_GRACE_S)
        end_group(self.process.pid, _EXIT_GRACE_S)
        self.kill()


class ProcessExecutor:
    """Workers in processes of their own on this machine, all computing at once; a rank group's
    worker in one process per rank."""

    def __init__(self, alloc: AllocationConfig | None = None) -> None:
        self.alloc = alloc or AllocationConfig()
        self.roster = Roster(self.alloc, self._retire)
        self._procs: dict[str, list[_Proc]] = {}  # a worker's processes, in rank order
        self._threads: dict[str, int] = {}
        self._gpus: dict[str, tuple[int, ...] | None] = {}
        # Calls may come from several driver threads at once (a paced run steps each policy in a
        # thread of its own): one pipe per worker carries one call at a time (``_holding``).
        self._lock = threading.RLock()
        self._pipes: dict[str, threading.Lock] = {}

    def start(self, factories: dict[str, Callable[[], object]], plan: Plan | None = None) -> None:
        self.roster.factories = dict(factories)
        for n, factory in factories.items():
            a = next((a for a in plan.assignments if a.worker == n), None) if plan else None
            if a and len({s.node for s in a.gpus}) > 1:
                raise ValueError(
                    f"worker {n!r} is planned across {len({s.node for s in a.gpus})} "
                    "nodes; the process executor runs on one machine: use "
                    'allocation.executor = "ray"'
                )
            self._threads[n] = rank_threads(a.threads if a else 0, group_size(factory))
            self._gpus[n] = tuple(sorted({s.gpu for s in a.gpus})) if a and a.gpus else None
        for n in factories:
            self._spawn(n)
        results = self._collect(list(factories), "__init__", self.alloc.call_timeout_s)
        check_built(results, self.shutdown)

    def _spawn(self, name: str) -> None:
        factory, gpus, threads = self.roster.factories[name], self._gpus[name], self._threads[name]
        if not isinstance(factory, RankGroup):
            self._procs[name] = [_Proc(name, factory, worker_env(threads, gpus), threads)]
            return
        check_rank_gpus(name, factory.ranks, len(gpus or ()))
        port = self.roster.rank_port(name) or free_port()
        self._procs[name] = [
            _Proc(
                f"{name}-rank{r}",
                rank_factory,
                {
                    **worker_env(threads, None if gpus is None else (gpus[r],)),
                    **rank_env(r, factory.ranks, "127.0.0.1", port),
                },
                threads,
            )
            for r, rank_factory in enumerate(self.roster.rank_factories(name))
        ]

    def put(self, obj: Any) -> Any:
        return obj  # pickled into each call that carries it

    def live_workers(self) -> list[str]:
        return self.roster.live()

    def removed(self) -> dict[str, WorkerFailure]:
        return self.roster.removed()

    def call(
        self, calls: dict[str, WorkerCall], timeout_s: float | None = None, *, fetch: bool = True
    ) -> dict[str, CallResult]:
        """Send each named worker its call (every rank of a group), then gather the replies
        (``fetch`` is the Ray executor's; here every value comes back). With these workers'
        pipes held but not the executor's lock: retiring a failed worker waits for its process
        to end, and other workers' calls go on meanwhile."""

        def send(live: dict[str, WorkerCall], method: str, timeout: float) -> dict[str, CallResult]:
            unsent = {n: f for n, c in live.items() if (f := self._send(n, c, method)) is not None}
            sent = [n for n in live if n not in unsent]
            return {**unsent, **self._collect(sent, method, timeout)}

        return self.roster.call(calls, timeout_s, send, hold=self._holding)

    def _send(self, name: str, call: WorkerCall, method: str) -> CallResult | None:
        """The call to every process of ``name``; a failure when it cannot go."""
        try:
            for proc in self._procs[name]:
                proc.conn.send(call)
            return None
        except (OSError, ValueError, pickle.PicklingError) as exc:
            # a process that died between calls breaks its pipe: it is the death, as when it
            # dies during a call (``_receive``), not the pipe, that failed
            dead = [p.process.exitcode for p in self._procs[name] if not p.process.is_alive()]
            self._kill(name)
            if isinstance(exc, OSError) and dead:
                why = f"its process exited with code {dead[0]}"
                return failure_result(name, method, "WorkerDied", why)
            return failure_result(name, method, type(exc).__name__, f"cannot send: {exc}")

    @contextlib.contextmanager
    def _holding(self, names: list[str]):
        """The pipes of ``names``, taken in sorted order (two callers never wait on each other
        in a circle), for one call's send and reply."""
        with self._lock:
            locks = [self._pipes.setdefault(n, threading.Lock()) for n in names]
        with contextlib.ExitStack() as stack:
            for lock in locks:
                stack.enter_context(lock)
            yield

    def busy_seconds(self) -> dict[str, float]:
        """Seconds each worker has spent inside calls so far, as its process measured them."""
        return self.roster.busy_seconds()

    def _collect(self, names: list[str], method: str, timeout_s: float) -> dict[str, CallResult]:
        """One reply per process within ``timeout_s``; a process that died or hung is a failure
        of its worker, and a rank group's failed rank ends its other ranks (``RankReplies``)."""
        return RankReplies(
            {n: [p.conn for p in self._procs[n]] for n in names},
            method,
            timeout_s,
            ready=lambda conns, left: wait(conns, timeout=left),
            receive=lambda name, rank, late: self._receive(name, rank, method),
            kill=self._kill,
            hung="; its process was killed",
        ).results()

    def _receive(self, name: str, rank: int, method: str) -> CallResult:
        proc = self._procs[name][rank]
        try:
            reply = proc.conn.recv()
        except (EOFError, OSError):
            proc.process.join(_EXIT_GRACE_S)
            why = f"its process exited with code {proc.process.exitcode}"
            return failure_result(name, method, "WorkerDied", why)
        if rank == 0:  # a rank group's ranks compute together: its time is rank 0's
            self.roster.add_busy(name, reply[-1])
        if reply[0] == "ok":
            return CallResult(name, value=reply[1])
        return raised_failure(name, method, reply)

    def _kill(self, name: str) -> None:
        for proc in self._procs.get(name, ()):
            proc.kill()

    def _retire(self, name: str) -> None:
        """A failed worker's processes, as ``continue`` drops them. One that raised still
        answers: asked to stop, it closes its worker (a vLLM engine's scratch folder) and ends
        what it started, as at the end of a run. One that
        hung or died, or a failed rank group, was killed already: nothing is waited for. Then
        the scratch folders of those killed before they could close are swept (every failed
        worker is retired, or shut down)."""
        for proc in self._procs.pop(name, ()):
            proc.stop()
        sweep_left_scratch()

    def shutdown(self) -> None:
        """Every worker asked at once, so their own shutdowns (an engine's: about 4 s) overlap."""
        procs = [proc for name in list(self._procs) for proc in self._procs.pop(name)]
        for proc in procs:
            proc.ask_to_stop()
        for proc in procs:
            proc.stop()
        sweep_left_scratch()
