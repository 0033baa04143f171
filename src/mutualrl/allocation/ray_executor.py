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

Moving experience: ``put(obj)`` returns an ``ObjectRef``; ``call(..., fetch=False)`` returns each
worker's value as an ``ObjectRef`` without copying it through the driver. A call travels as its
class and its fields; refs that are *top-level* fields of a call are resolved by Ray inside the
receiving actor (from the object store, node to node); refs nested inside containers arrive as
refs and the worker calls ``ray.get`` itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from mutualrl.config import AllocationConfig
from mutualrl.allocation.calls import (CallResult, FailurePolicy, WorkerCall, WorkerFailedError,
                                       WorkerFailure, build_worker, call_fields, call_name,
                                       check_names)
from mutualrl.allocation.planner import Assignment, Plan


class PlacementError(RuntimeError):
    """Placement groups that could not all be reserved in time."""


class _Host:
    """The actor around one worker object; statuses and values travel as separate objects."""

    def __init__(self, factory: Callable[[], object], threads: int, restarted: bool) -> None:
        self.obj = build_worker(factory, restarted)
        import sys
        if threads > 0 and "torch" in sys.modules:  # each actor is its own process: exact share
            sys.modules["torch"].set_num_threads(threads)

    def ready(self) -> bool:
        return True

    def invoke(self, _mutualrl_call: type, **fields: Any) -> tuple[tuple, Any]:
        # The call's fields travel as Ray task arguments, so top-level ObjectRefs among them are
        # resolved here, in this actor, straight from the object store; the call is rebuilt here.
        import traceback
        try:
            return ("ok",), _mutualrl_call(**fields)(self.obj)
        except Exception as exc:
            tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            return ("raised", type(exc).__name__, str(exc), tb), None


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
    return {k: v for k, v in sorted(resources.items())
            if "_group_" not in k and not k.startswith(("bundle_group", "node:"))}


def _share(amount: float, ways: int) -> float:
    # Ray accepts fractional resource requests only below 1; above it, whole units.
    each = amount / ways
    return round(each, 4) if each < 1 else float(int(each))


class RayExecutor:
    def __init__(self, alloc: AllocationConfig | None = None) -> None:
        self.alloc = alloc or AllocationConfig()
        self.policy = FailurePolicy(self.alloc)
        self._factories: dict[str, Callable[[], object]] = {}
        self._options: dict[str, dict] = {}
        self._threads: dict[str, int] = {}
        self._actors: dict[str, Any] = {}
        self._pgs: dict[str, PlacementGroup] = {}

    # ---- placement --------------------------------------------------------------------------

    def _gangs(self, names: list[str], plan: Plan | None) -> dict[str, list[Assignment]]:
        if plan is None:  # no plan: every worker alone, one CPU each
            return {n: [Assignment(worker=n, role="learner", policy=None, group=n,
                                   num_parameters=0, tokens_per_step=0, cost=0.0, cost_share=0.0,
                                   memory_bytes=0, node=0, gpus=(), threads=1)] for n in names}
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
        done, _ = ray.wait(list(ready_refs), num_returns=len(ready_refs),
                           timeout=self.alloc.placement_timeout_s)
        pending = sorted(set(ready_refs.values()) - {ready_refs[r] for r in done})
        if pending:
            msg = self._placement_diagnostic(pending, asked)
            self._release()
            raise PlacementError(msg)

    def _placement_diagnostic(self, pending: list[str], asked: dict[str, list[dict]]) -> str:
        lines = [f"could not reserve {len(pending)} of {len(self._pgs)} placement group(s) within "
                 f"{self.alloc.placement_timeout_s:g} s (all or nothing: none are kept):"]
        for g in pending:
            state = placement_group_table(self._pgs[g]).get("stats", {}).get("scheduling_state", "?")
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
            key = "num_gpus" if self.alloc.gpu_resource == "GPU" else "resources"
            share = _share(gpus, ways)
            opts[key] = share if key == "num_gpus" else {self.alloc.gpu_resource: share}
        opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            self._pgs[gang], placement_group_bundle_index=b)
        return opts

    # ---- the Executor protocol --------------------------------------------------------------

    def start(self, factories: dict[str, Callable[[], object]], plan: Plan | None = None) -> None:
        if not ray.is_initialized():
            ray.init(address=self.alloc.ray_address, include_dashboard=False)
        self._factories = dict(factories)
        gangs = self._gangs(list(factories), plan)
        self._reserve(gangs)
        for g, members in gangs.items():
            for i, a in enumerate(members):
                self._options[a.worker] = self._actor_options(g, members, i)
                self._threads[a.worker] = a.threads
        for n in factories:
            self._spawn(n, restarted=False)
        results = self._wait({n: self._actors[n].ready.remote() for n in factories}, "__init__",
                             self.alloc.call_timeout_s, statuses=False)
        failures = [r.failure for r in results.values() if r.failure is not None]
        if failures:
            self.shutdown()
            raise WorkerFailedError(failures, results)

    def _spawn(self, name: str, restarted: bool) -> None:
        cls = ray.remote(_Host)
        self._actors[name] = cls.options(**self._options[name]).remote(
            self._factories[name], self._threads[name], restarted)

    def put(self, obj: Any) -> Any:
        return ray.put(obj)

    def live_workers(self) -> list[str]:
        return [n for n in self._factories if n not in self.policy.removed]

    def call(self, calls: dict[str, WorkerCall], timeout_s: float | None = None, *,
             fetch: bool = True) -> dict[str, CallResult]:
        method = call_name(next(iter(calls.values()))) if calls else "call"
        check_names(method, calls, self._factories)
        live = [n for n in calls if n not in self.policy.removed]
        refs = {n: self._actors[n].invoke.options(num_returns=2).remote(type(calls[n]),
                                                                         **call_fields(calls[n]))
                for n in live}
        results = self._wait(refs, method, timeout_s or self.alloc.call_timeout_s,
                             statuses=True, fetch=fetch)
        for n in calls:
            if n not in live:
                results[n] = self.policy.unavailable(n, method)
        self.policy.apply(results, self._restart, self._remove)
        return {n: results[n] for n in calls}

    def _wait(self, refs: dict[str, Any], method: str, timeout_s: float, *, statuses: bool,
              fetch: bool = True) -> dict[str, CallResult]:
        first = {n: (r[0] if statuses else r) for n, r in refs.items()}
        ready, _ = ray.wait(list(first.values()), num_returns=len(first), timeout=timeout_s)
        done = set(ready)
        out: dict[str, CallResult] = {}
        for n, ref in first.items():
            if ref not in done:
                out[n] = CallResult(n, failure=WorkerFailure(
                    worker=n, method=method, exc_type="TimeoutError", kind="timeout", traceback="",
                    message=f"no result within {timeout_s:g} s from its actor"))
                continue
            try:
                status = ray.get(ref)
            except Exception as exc:  # the actor died, or its constructor raised
                out[n] = CallResult(n, failure=WorkerFailure(
                    worker=n, method=method, exc_type=type(exc).__name__, message=str(exc)[:2000],
                    traceback=str(exc), kind="raised"))
                continue
            if statuses and status[0] != "ok":
                out[n] = CallResult(n, failure=WorkerFailure(
                    worker=n, method=method, exc_type=status[1], message=status[2],
                    traceback=status[3], kind="raised"))
            elif statuses:
                out[n] = CallResult(n, value=ray.get(refs[n][1]) if fetch else refs[n][1])
            else:
                out[n] = CallResult(n, value=status)
        return out

    def _restart(self, name: str) -> None:
        ray.kill(self._actors.pop(name))  # frees its share of the bundle for the new actor
        self._spawn(name, restarted=True)
        res = self._wait({name: self._actors[name].ready.remote()}, "restart",
                         self.alloc.call_timeout_s, statuses=False)
        if not res[name].ok:
            raise RuntimeError(f"restart of worker {name!r} failed: {res[name].failure}")

    def _remove(self, name: str) -> None:
        actor = self._actors.pop(name, None)
        if actor is not None:
            ray.kill(actor)

    def shutdown(self) -> None:
        for name in list(self._actors):
            self._remove(name)
        self._release()
