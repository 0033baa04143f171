"""The Ray executor: one placement group per gang, one actor per worker (extra ``ray``).

Gangs are the plan's colocation groups. Their placement groups are created in one fixed global
order (sorted by gang name) and all must be ready within ``placement_timeout_s`` — all or
nothing: if any is not, every group is removed again and ``PlacementError`` says which bundle
could not be placed, what it asked for and what the cluster has available. Two drivers asking
in the same order cannot each hold half of what the other needs.

Bundles: one per node the gang spans (``STRICT_PACK`` for one node, ``STRICT_SPREAD`` across
several), holding the gang's planned GPUs (resource name ``gpu_resource``, so tests can use a fake
one) and CPU threads. Each of the gang's actors takes an equal share of its bundle. Ray only
allows fractional GPU requests below 1, so colocated workers genuinely share a GPU when the gang
has one, but with more than one GPU each actor gets a disjoint whole-GPU share; workers that must
share several GPUs should be one object playing both roles.

A rank group (``workers.ranks.RankGroup``: a policy whose learner is sharded) is one actor per
rank in its gang's placement group, each holding one of the gang's GPUs on the node the plan put
it (its bundle) and an equal share of its threads. The actors are placed first; rank 0's actor
names the rendezvous (its node's address and a free port there); then every rank joins the
process group and builds its worker at once. Calls go to every rank and rank 0 answers; a rank
that fails ends its group's actors (they would wait in a collective for it).

Moving experience: ``put(obj)`` returns an ``ObjectRef``; ``call(..., fetch=False)`` returns each
worker's value as an ``ObjectRef`` without copying it through the driver. A call travels as its
class and its fields; refs that are *top-level* fields of a call are resolved by Ray inside the
receiving actor (from the object store, node to node); refs nested inside containers arrive as
refs and the worker calls ``ray.get`` itself.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from mutualrl.allocation.planner import Assignment, Plan
from mutualrl.config import AllocationConfig
from mutualrl.workers.calls import (
    CallResult,
    WorkerCall,
    WorkerFailure,
    call_fields,
    close_worker,
)
from mutualrl.workers.ending import sweep_left_scratch
from mutualrl.workers.ranks import RankFactory, RankGroup, free_port, rank_env
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

# How long a shutdown waits for its workers to close before it kills them.
CLOSE_TIMEOUT_S = 10.0
# How long a node's sweep waits for the processes of killed actors to end (``ray.kill`` returns
# before they have; on a loaded node it can take seconds).
KILLED_EXIT_WAIT_S = 10.0


class PlacementError(RuntimeError):
    """Placement groups that could not all be reserved in time."""


def _set_threads(threads: int) -> None:
    import sys

    if threads > 0 and "torch" in sys.modules:  # each actor is its own process: exact share
        sys.modules["torch"].set_num_threads(threads)


def _invoke(obj: object, call: type, fields: dict) -> tuple[tuple, Any]:
    # The call's fields travel as Ray task arguments, so top-level ObjectRefs among them are
    # resolved in the actor, straight from the object store; the call is rebuilt there. The
    # status ends with the seconds the call took in the actor (the worker's busy time).
    t0 = time.perf_counter()
    try:
        value = call(**fields)(obj)
        return ("ok", time.perf_counter() - t0), value
    except Exception as exc:
        return raised_status(exc, time.perf_counter() - t0), None


class _Hosting:
    """What every actor around a worker object answers: its calls, and its close at the end."""

    obj: object = None

    def invoke(self, _mutualrl_call: type, **fields: Any) -> tuple[tuple, Any]:
        return _invoke(self.obj, _mutualrl_call, fields)

    def close(self, name: str) -> None:
        if self.obj is not None:
            close_worker(name, self.obj)

    def where(self) -> tuple[str, int]:
        """This actor's node and process id: where its scratch folders are, and whose end a
        sweep of that node waits for once the actor is killed (``RayExecutor._retire``)."""
        import os

        return ray.get_runtime_context().get_node_id(), os.getpid()


class _Host(_Hosting):
    """The actor around one worker object; statuses and values travel as separate objects."""

    def __init__(self, factory: Callable[[], object], threads: int) -> None:
        self.obj = factory()
        _set_threads(threads)

    def ready(self) -> tuple:
        return ("ok", 0.0)


class _RankHost(_Hosting):
    """The actor around one rank of a rank group: placed empty, then joined and built."""

    def rendezvous(self) -> tuple[str, int]:
        """This node's address and a port free on it (asked of rank 0's actor)."""
        addr = ray.util.get_node_ip_address()
        return addr, free_port(addr)

    def join(self, factory: RankFactory, env: dict[str, str], threads: int) -> tuple:
        import os

        os.environ.update(env)
        try:
            self.obj = factory()
        except Exception as exc:  # reported as the rank's failure, never swallowed
            return raised_status(exc)
        _set_threads(threads)
        return ("ok", 0.0)


def _gang_bundles(members: list[Assignment], gpu_resource: str) -> list[dict[str, float]]:
    """One bundle per node the gang spans; its CPU threads go with its first node."""
    per_node: dict[int, float] = {}
    for slot in members[0].gpus:
        per_node[slot.node] = per_node.get(slot.node, 0.0) + slot.fraction
    bundles = [{gpu_resource: g} for _, g in sorted(per_node.items())] or [{}]
    if members[0].threads:
        bundles[0]["CPU"] = float(members[0].threads)
    return bundles if bundles[0] else []


def _plain(resources: dict[str, float]) -> dict[str, float]:
    """Drop Ray's per-placement-group bookkeeping resources; keep what a user asked for."""
    return {
        k: v
        for k, v in sorted(resources.items())
        if "_group_" not in k and not k.startswith(("bundle_group", "node:"))
    }


def _share(amount: float, ways: int) -> float:
    # Ray accepts fractional resource requests only below 1; above it, whole units.
    each = amount / ways
    return round(each, 4) if each < 1 else float(int(each))


class RayExecutor:
    def __init__(self, alloc: AllocationConfig | None = None) -> None:
        self.alloc = alloc or AllocationConfig()
        self.roster = Roster(self.alloc, self._remove)
        self._options: dict[str, dict] = {}
        self._threads: dict[str, int] = {}
        self._actors: dict[str, Any] = {}
        self._where: dict[str, list[tuple[str, int]]] = {}  # worker -> its actors' node, pid
        self._pgs: dict[str, PlacementGroup] = {}

    # ---- placement --------------------------------------------------------------------------

    def _gangs(self, names: list[str], plan: Plan | None) -> dict[str, list[Assignment]]:
        if plan is None:  # no plan: every worker alone, one CPU each
            return {
                n: [
                    Assignment(
                        worker=n,
                        role="learner",
                        policy=None,
                        group=n,
                        num_parameters=0,
                        tokens_per_step=0,
                        cost=0.0,
                        cost_share=0.0,
                        memory_bytes=0,
                        node=0,
                        gpus=(),
                        threads=1,
                    )
                ]
                for n in names
            }
        groups = {g: [a for a in m if a.worker in names] for g, m in plan.groups().items()}
        missing = sorted(set(names) - {a.worker for m in groups.values() for a in m})
        if missing:
            raise ValueError(f"ray executor: workers {missing} have no assignment in the plan")
        return {g: m for g, m in sorted(groups.items()) if m}

    def _reserve(self, gangs: dict[str, list[Assignment]]) -> None:
        asked = {g: _gang_bundles(m, self.alloc.gpu_resource) for g, m in gangs.items()}
        for g, bundles in asked.items():  # the fixed global order: sorted gang names
            if bundles:
                strategy = "STRICT_PACK" if len(bundles) == 1 else "STRICT_SPREAD"
                self._pgs[g] = placement_group(bundles, strategy=strategy, name=f"mutualrl-{g}")
        # One bounded wait over every group's ready() ref (pg.wait() rounds its timeout down to
        # whole seconds, which turns a sub-second budget into no wait at all).
        ready_refs = {pg.ready(): g for g, pg in self._pgs.items()}
        done, _ = ray.wait(
            list(ready_refs), num_returns=len(ready_refs), timeout=self.alloc.placement_timeout_s
        )
        pending = sorted(set(ready_refs.values()) - {ready_refs[r] for r in done})
        if pending:
            msg = self._placement_diagnostic(pending, asked)
            self._release()
            raise PlacementError(msg)

    def _placement_diagnostic(self, pending: list[str], asked: dict[str, list[dict]]) -> str:
        lines = [
            f"could not reserve {len(pending)} of {len(self._pgs)} placement group(s) within "
            f"{self.alloc.placement_timeout_s:g} s (all or nothing: none are kept):"
        ]
        for g in pending:
            state = (
                placement_group_table(self._pgs[g]).get("stats", {}).get("scheduling_state", "?")
            )
            for i, b in enumerate(asked[g]):
                lines.append(f"  gang {g!r} bundle {i}: asks {b} ({state})")
        lines.append(f"  available now: {_plain(ray.available_resources())}")
        lines.append(f"  cluster total: {_plain(ray.cluster_resources())}")
        return "\n".join(lines)

    def _release(self) -> None:
        for pg in self._pgs.values():
            remove_placement_group(pg)
        self._pgs.clear()

    def _actor_options(self, gang: str, members: list[Assignment], i: int) -> dict:
        bundles = _gang_bundles(members, self.alloc.gpu_resource)
        opts: dict[str, Any] = {"num_cpus": 0, "max_restarts": 0}
        if not bundles:
            return opts
        b = i % len(bundles)
        ways = sum(1 for j in range(len(members)) if j % len(bundles) == b)
        opts["num_cpus"] = _share(bundles[b].get("CPU", 0.0), ways)
        gpus = bundles[b].get(self.alloc.gpu_resource, 0.0)
        if gpus:
            self._gpu_option(opts, _share(gpus, ways))
        opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            self._pgs[gang], placement_group_bundle_index=b
        )
        return opts

    def _gpu_option(self, opts: dict, share: float) -> None:
        key = "num_gpus" if self.alloc.gpu_resource == "GPU" else "resources"
        opts[key] = share if key == "num_gpus" else {self.alloc.gpu_resource: share}

    def _rank_options(self, gang: str, a: Assignment, rank: int, ranks: int) -> dict:
        """Rank ``rank``'s actor: one whole GPU of its node's bundle, an equal share of the
        bundle's threads with the other ranks there."""
        check_rank_gpus(a.worker, ranks, len(a.gpus))
        bundles = _gang_bundles([a], self.alloc.gpu_resource)
        opts: dict[str, Any] = {"num_cpus": 0, "max_restarts": 0}
        if not bundles:
            return opts
        node = a.gpus[rank].node if a.gpus else None
        b = sorted({s.node for s in a.gpus}).index(node) if a.gpus else 0
        here = sum(1 for s in a.gpus[:ranks] if s.node == node) if a.gpus else ranks
        opts["num_cpus"] = _share(bundles[b].get("CPU", 0.0), here)
        if a.gpus:
            self._gpu_option(opts, 1.0)
        opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            self._pgs[gang], placement_group_bundle_index=b
        )
        return opts

    # ---- the Executor protocol --------------------------------------------------------------

    def start(self, factories: dict[str, Callable[[], object]], plan: Plan | None = None) -> None:
        if not ray.is_initialized():
            ray.init(address=self.alloc.ray_address, include_dashboard=False)
        self.roster.factories = dict(factories)
        gangs = self._gangs(list(factories), plan)
        self._reserve(gangs)
        try:
            for g, members in gangs.items():
                for i, a in enumerate(members):
                    f = factories[a.worker]
                    self._options[a.worker] = (
                        [self._rank_options(g, a, r, f.ranks) for r in range(f.ranks)]
                        if isinstance(f, RankGroup)
                        else [self._actor_options(g, members, i)]
                    )
                    self._threads[a.worker] = a.threads
            ready = {n: self._spawn(n) for n in factories}
        except BaseException:
            self.shutdown()
            raise
        check_built(self._wait(ready, "__init__", self.alloc.call_timeout_s), self.shutdown)
        self._locate(list(factories))

    def _locate(self, names: list[str]) -> None:
        """Each actor's node and pid, asked once it is built (a hung actor could not answer)."""
        refs = {n: [a.where.remote() for a in self._actors[n]] for n in names}
        for n, per in refs.items():
            self._where[n] = ray.get(per, timeout=self.alloc.call_timeout_s)

    def _spawn(self, name: str) -> list:
        """Start the worker's actor(s); the refs that say each is built."""
        factory, threads = self.roster.factories[name], self._threads[name]
        if not isinstance(factory, RankGroup):
            actor = ray.remote(_Host).options(**self._options[name][0]).remote(factory, threads)
            self._actors[name] = [actor]
            return [actor.ready.remote()]
        actors = [ray.remote(_RankHost).options(**o).remote() for o in self._options[name]]
        self._actors[name] = actors
        addr, port = ray.get(actors[0].rendezvous.remote(), timeout=self.alloc.call_timeout_s)
        port = self.roster.rank_port(name) or port
        each = rank_threads(threads, factory.ranks)
        return [
            a.join.remote(rank_factory, rank_env(r, factory.ranks, addr, port), each)
            for r, (a, rank_factory) in enumerate(zip(actors, self.roster.rank_factories(name)))
        ]

    def put(self, obj: Any) -> Any:
        return ray.put(obj)

    def busy_seconds(self) -> dict[str, float]:
        """Seconds each worker has spent inside calls so far, as its actor timed them (the
        transfers to and from it aside)."""
        return self.roster.busy_seconds()

    def live_workers(self) -> list[str]:
        return self.roster.live()

    def removed(self) -> dict[str, WorkerFailure]:
        return self.roster.removed()

    def call(
        self, calls: dict[str, WorkerCall], timeout_s: float | None = None, *, fetch: bool = True
    ) -> dict[str, CallResult]:
        def send(live: dict[str, WorkerCall], method: str, timeout: float) -> dict[str, CallResult]:
            refs = {
                n: [
                    a.invoke.options(num_returns=2).remote(type(call), **call_fields(call))
                    for a in self._actors[n]
                ]
                for n, call in live.items()
            }
            return self._wait(refs, method, timeout, fetch=fetch)

        return self.roster.call(calls, timeout_s, send)

    def _wait(
        self, refs: dict[str, list], method: str, timeout_s: float, *, fetch: bool = True
    ) -> dict[str, CallResult]:
        """Every worker's result within ``timeout_s``. ``refs[name]``: per rank, a status ref,
        or a (status, value) pair of refs. A failed rank ends its group's actors at once, and so
        does a hung one: it would never get to a close() (``_retire``)."""

        def receive(name: str, rank: int, late: bool) -> CallResult:
            first = rank == 0 and not late  # a failed group's late rank: neither timed nor fetched
            return self._result(name, method, refs[name][rank], fetch and first, first)

        return RankReplies(
            {n: [x[0] if isinstance(x, list) else x for x in per] for n, per in refs.items()},
            method,
            timeout_s,
            ready=lambda pending, left: ray.wait(pending, num_returns=1, timeout=left)[0],
            receive=receive,
            kill=self._kill,
            hung=" from its actor",
        ).results()

    def _result(self, name: str, method: str, refs: Any, fetch: bool, timed: bool) -> CallResult:
        status_ref = refs[0] if isinstance(refs, list) else refs
        try:
            status = ray.get(status_ref)
        except Exception as exc:  # the actor died, or its constructor raised
            return failure_result(
                name, method, type(exc).__name__, str(exc)[:2000], traceback=str(exc)
            )
        if timed:  # a rank group's ranks compute together: its time is rank 0's
            self.roster.add_busy(name, status[-1])
        if status[0] != "ok":
            return raised_failure(name, method, status)
        if not isinstance(refs, list):
            return CallResult(name)
        return CallResult(name, value=ray.get(refs[1]) if fetch else refs[1])

    def _kill(self, name: str) -> None:
        for actor in self._actors.get(name, ()):
            ray.kill(actor)

    def _retire(self, names: list[str]) -> None:
        """Close the workers' objects (a vLLM engine's scratch folder is on its actor's node), all
        at once, then kill their actors. One that raised still answers and closes; a hung one
        was killed already, and a busy one is killed when ``CLOSE_TIMEOUT_S`` is up."""
        actors = {n: self._actors.pop(n, []) for n in names}
        refs = [a.close.remote(n) for n, per in actors.items() for a in per]
        if refs:
            with contextlib.suppress(Exception):
                ray.wait(refs, num_returns=len(refs), timeout=CLOSE_TIMEOUT_S)
        for per in actors.values():
            for actor in per:
                ray.kill(actor)
        self._sweep([w for n in names for w in self._where.pop(n, [])])

    def _sweep(self, where: list[tuple[str, int]]) -> None:
        """On each node that held one of these (killed) actors, once their processes are gone,
        remove the scratch folders of actors killed before they could close (a hung one, or one
        slower to close than ``CLOSE_TIMEOUT_S``: a vLLM engine's copy of its model), which
        would otherwise stay until the next engine made on that node. Only folders whose owner
        is gone are touched."""
        nodes: dict[str, list[int]] = {}
        for node, pid in where:
            nodes.setdefault(node, []).append(pid)
        refs = [
            ray.remote(num_cpus=0)(sweep_left_scratch)
            .options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
            .remote(pids, KILLED_EXIT_WAIT_S)
            for node, pids in nodes.items()
        ]
        if refs:
            with contextlib.suppress(Exception):  # a node gone with its actors: nothing to do
                ray.wait(refs, num_returns=len(refs), timeout=KILLED_EXIT_WAIT_S + 10.0)

    def _remove(self, name: str) -> None:
        self._retire([name])

    def shutdown(self) -> None:
        self._retire(list(self._actors))  # the live workers: a removed one has no actors left
        self._release()
