"""The pure planner: worker specs + inventory -> a plan of devices and CPU threads per worker.

Order of decisions, each deterministic:

1. Workers with the same ``group`` are colocated: they share devices and threads (a policy's
   generator and learner alternate in time), so the group is the unit that gets resources; its
   memory is the sum of its members' (both stay resident), its cost the sum of their costs.
2. Memory-feasible minimums first, all or nothing. A group of workers that run as processes on
   one GPU each (``WorkerSpec.ranks``: a policy's generator and learner, the learner sharded over
   N ranks) gets exactly as many GPUs as its most ranks, and every member's rank 0 shares the
   first of them, so that GPU must hold the sum of their per-rank memory. A group described only
   by its total memory gets the fewest whole GPUs whose usable memory holds it (spread evenly).
   On a CPU-only inventory a group needs a node whose host RAM holds all of its ranks. If any
   group cannot be placed, nothing is planned and ``PlanError`` names each worker, what it needs
   (per GPU and on how many) and what is available.
3. The capacity left after minimums is split in proportion to cost by largest remainder
   (integral, sums exactly to capacity, ties broken by group name): CPU threads per node among
   all groups; spare GPUs among the groups described by their total only (a group of ranks has
   no use for a GPU beyond its ranks: spare GPUs stay free, and the plan says so).

When there are fewer GPUs than groups, groups that fit in one GPU share GPUs (first-fit
decreasing by memory); each gets a fraction of its GPU's compute in proportion to cost.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction
from typing import Literal

import msgspec

from mutualrl.allocation.specs import Inventory, WorkerSpec
from mutualrl.config import GIB


class PlanError(ValueError):
    """No plan satisfies every worker's memory need; the message lists who needs what."""


class GpuSlot(msgspec.Struct, frozen=True):
    node: int
    gpu: int  # index within the node
    fraction: float = 1.0  # share of this GPU's compute (< 1 when GPUs are shared)


class Assignment(msgspec.Struct, frozen=True, kw_only=True):
    worker: str
    role: str
    policy: str | None
    group: str
    num_parameters: int
    tokens_per_step: int
    cost: float
    cost_share: float  # of the whole plan's cost
    memory_bytes: int  # per rank when ranks is set
    node: int  # where its CPU threads are (its first GPU's node)
    gpus: tuple[GpuSlot, ...]  # empty: runs on CPU
    threads: int  # CPU threads; colocated workers share the same threads
    ranks: int | None = None  # processes, one per GPU (WorkerSpec.ranks)


class Plan(msgspec.Struct, frozen=True, kw_only=True):
    inventory: Inventory
    mode: Literal["gpu", "cpu"]
    assignments: tuple[Assignment, ...]
    oversubscribed: bool = False  # more minimum threads than cores: they time-share
    notes: tuple[str, ...] = ()

    def __getitem__(self, worker: str) -> Assignment:
        for a in self.assignments:
            if a.worker == worker:
                return a
        raise KeyError(
            f"plan has no worker {worker!r}; workers: {[a.worker for a in self.assignments]}"
        )

    def groups(self) -> dict[str, list[Assignment]]:
        out: dict[str, list[Assignment]] = {}
        for a in self.assignments:
            out.setdefault(a.group, []).append(a)
        return out


class _Group(msgspec.Struct, kw_only=True):
    name: str
    members: list[WorkerSpec]
    memory: int  # all of it, every rank
    cost: float
    min_threads: int
    accel: bool
    ranks: int | None  # GPUs it runs on, when its members run as ranks
    peak: int  # on its busiest GPU (the first) when ranks is set


def _group(name: str, members: list[WorkerSpec]) -> _Group:
    ranked = [s for s in members if s.ranks is not None]
    ranks = max((s.ranks for s in ranked if s.ranks is not None), default=None)
    spread = sum(s.memory_bytes for s in members if s.ranks is None)
    peak = sum(s.memory_bytes for s in ranked) + (-(-spread // ranks) if ranks else spread)
    # Colocated workers alternate in time, so the group needs the largest minimum, not the sum.
    return _Group(
        name=name,
        members=members,
        memory=sum(s.total_memory_bytes for s in members),
        cost=sum(s.cost for s in members),
        min_threads=max(s.min_threads for s in members),
        accel=any(s.uses_accelerator for s in members),
        ranks=ranks,
        peak=peak,
    )


def largest_remainder(total: int, weights: Sequence[float], keys: Sequence[str]) -> list[int]:
    """Split ``total`` units in proportion to ``weights``: integral, summing exactly to ``total``.

    Quotas are exact rationals (no float drift decides a unit); leftover units go to the largest
    fractional parts, ties to the smallest key. All-zero weights split evenly.
    """
    if total < 0:
        raise ValueError(f"largest_remainder: total must be >= 0, got {total}")
    if len(weights) != len(keys):
        raise ValueError("largest_remainder: weights and keys differ in length")
    if not weights:
        if total:
            raise ValueError(f"largest_remainder: {total} units but nobody to give them to")
        return []
    exact = [Fraction(w) for w in weights]
    if any(w < 0 for w in exact):
        raise ValueError(f"largest_remainder: weights must be >= 0, got {list(weights)}")
    if sum(exact) == 0:
        exact = [Fraction(1)] * len(exact)
    s = sum(exact)
    quotas = [total * w / s for w in exact]
    base = [math.floor(q) for q in quotas]
    order = sorted(range(len(base)), key=lambda i: (-(quotas[i] - base[i]), keys[i]))
    for i in order[: total - sum(base)]:
        base[i] += 1
    return base


def _groups(specs: Sequence[WorkerSpec]) -> list[_Group]:
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise PlanError(f"worker names must be unique, got {names}")
    by: dict[str, list[WorkerSpec]] = {}
    for s in specs:
        by.setdefault(s.group, []).append(s)
    return [_group(g, m) for g, m in sorted(by.items())]


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def _need_lines(groups: Sequence[_Group], usable: int, unit: str) -> list[str]:
    lines = []
    for g in groups:
        for s in g.members:
            need = (
                _gib(s.memory_bytes)
                if s.ranks is None or unit == "node"
                else f"{_gib(s.memory_bytes)} on one GPU"
                if s.ranks == 1
                else f"{_gib(s.memory_bytes)} on each of {s.ranks} GPUs "
                f"(its {s.ranks} ranks' shards)"
            )
            lines.append(f"  {s.name} ({s.role}, {s.num_parameters:,} params) needs {need}")
        if g.ranks is not None and unit == "GPU":
            lines.append(
                f"    group {g.name!r}: {_gib(g.peak)} on its first GPU, of "
                f"{_gib(usable)} usable (more learner ranks shard the learner thinner)"
            )
        elif len(g.members) > 1:
            lines.append(
                f"    colocated group {g.name!r}: {_gib(g.memory)} = "
                f"{math.ceil(g.memory / usable)} {unit}(s) of {_gib(usable)} usable"
            )
    return lines


def _min_gpus(g: _Group, usable: int) -> int:
    return g.ranks if g.ranks is not None else max(1, math.ceil(g.memory / usable))


def _place_whole(counts: dict[str, int], inv: Inventory) -> dict[str, list[GpuSlot]]:
    """Concrete GPUs for whole-GPU counts: biggest first, best-fitting node, else span nodes."""
    free = {n: list(range(inv.gpus_per_node)) for n in range(inv.nodes)}
    out: dict[str, list[GpuSlot]] = {}
    for name, k in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        fits = [n for n in free if len(free[n]) >= k]
        if fits:
            node = min(fits, key=lambda n: (len(free[n]), n))
            out[name] = [GpuSlot(node, free[node].pop(0)) for _ in range(k)]
            continue
        slots: list[GpuSlot] = []
        for node in sorted(free, key=lambda n: (-len(free[n]), n)):
            while free[node] and len(slots) < k:
                slots.append(GpuSlot(node, free[node].pop(0)))
        out[name] = slots
    return out


def _pack_shared(groups: list[_Group], inv: Inventory, usable: int) -> dict[str, list[GpuSlot]]:
    """Fewer GPUs than groups: multi-GPU groups take whole GPUs, the rest share by memory."""
    big = {g.name: _min_gpus(g, usable) for g in groups if _min_gpus(g, usable) > 1}
    if sum(big.values()) > inv.total_gpus:
        needy = [g for g in groups if g.name in big]
        raise PlanError(
            _infeasible_msg(
                needy,
                inv,
                usable,
                f"{sum(big.values())} GPUs needed by "
                f"groups too big for one GPU, {inv.total_gpus} exist",
            )
        )
    out = _place_whole(big, inv) if big else {}
    used = {(s.node, s.gpu) for slots in out.values() for s in slots}
    bins = [
        (n, i) for n in range(inv.nodes) for i in range(inv.gpus_per_node) if (n, i) not in used
    ]
    room = {b: usable for b in bins}
    members: dict[tuple[int, int], list[_Group]] = {b: [] for b in bins}
    small = sorted((g for g in groups if g.name not in big), key=lambda g: (-g.memory, g.name))
    for g in small:
        target = next((b for b in bins if room[b] >= g.memory), None)
        if target is None:
            raise PlanError(_infeasible_msg(groups, inv, usable, "GPU memory left after packing"))
        room[target] -= g.memory  # one GPU: a ranked group's memory is its one rank's
        members[target].append(g)
    for b, gs in members.items():
        shares = largest_remainder(100, [g.cost for g in gs], [g.name for g in gs])
        for g, share in zip(gs, shares):
            out[g.name] = [GpuSlot(b[0], b[1], max(share, 1) / 100)]
    return out


def _infeasible_msg(groups: Sequence[_Group], inv: Inventory, usable: int, what: str) -> str:
    unit = "GPU" if not inv.cpu_only else "node"
    have = (
        f"{inv.nodes} node(s) x {inv.gpus_per_node} GPU(s) of {_gib(inv.gpu_memory_bytes)} "
        f"({_gib(usable)} usable each)"
        if not inv.cpu_only
        else f"{inv.nodes} node(s) with {_gib(inv.host_memory_bytes)} host memory "
        f"({_gib(usable)} usable each)"
    )
    return "\n".join(
        [
            f"no feasible plan ({what}); workers and their needs:",
            *_need_lines(groups, usable, unit),
            f"available: {have}",
        ]
    )


def _gpu_slots(groups: list[_Group], inv: Inventory, usable: int) -> tuple[dict, list[str]]:
    accel = [g for g in groups if g.accel]
    mins = {g.name: _min_gpus(g, usable) for g in accel}
    too_big = [g for g in accel if mins[g.name] > inv.total_gpus]
    if too_big:
        raise PlanError(_infeasible_msg(too_big, inv, usable, "a group needs more GPUs than exist"))
    too_full = [g for g in accel if g.ranks is not None and g.peak > usable]
    if too_full:
        raise PlanError(
            _infeasible_msg(too_full, inv, usable, "a GPU of a group cannot hold its share")
        )
    if sum(mins.values()) <= inv.total_gpus:
        takers = [g for g in accel if g.ranks is None]
        left = inv.total_gpus - sum(mins.values())
        spare = largest_remainder(
            left if takers else 0, [g.cost for g in takers], [g.name for g in takers]
        )
        extra = dict(zip((g.name for g in takers), spare))
        counts = {g.name: mins[g.name] + extra.get(g.name, 0) for g in accel}
        notes = (
            []
            if takers or not left
            else [
                f"{left} of {inv.total_gpus} GPUs stay free: every group runs on one GPU per rank "
                "(raise a policy's learner_ranks to shard it over more)"
            ]
        )
        return _place_whole(counts, inv), notes
    note = (
        f"{len(accel)} GPU groups need at least {sum(mins.values())} whole GPUs but "
        f"{inv.total_gpus} exist: groups that fit one GPU share GPUs"
    )
    return _pack_shared(accel, inv, usable), [note]


def _cpu_nodes(groups: list[_Group], inv: Inventory, usable: int) -> dict[str, int]:
    """CPU-only: first-fit decreasing of groups onto nodes by host memory."""
    room = [usable] * inv.nodes
    node_of: dict[str, int] = {}
    for g in sorted(groups, key=lambda g: (-g.memory, g.name)):
        node = next((n for n in range(inv.nodes) if room[n] >= g.memory), None)
        if node is None:
            raise PlanError(_infeasible_msg(groups, inv, usable, "host memory"))
        room[node] -= g.memory
        node_of[g.name] = node
    return node_of


def _threads(groups: list[_Group], node_of: dict[str, int], inv: Inventory) -> tuple[dict, bool]:
    """Each node's cores: minimums (>= 1 for compute groups), the rest in proportion to cost."""
    threads: dict[str, int] = {}
    over = False
    for node in range(inv.nodes):
        here = [g for g in groups if node_of[g.name] == node]
        mins = [max(g.min_threads, 1 if g.cost > 0 else 0) for g in here]
        spare = inv.cpus_per_node - sum(mins)
        over = over or spare < 0
        extra = largest_remainder(max(spare, 0), [g.cost for g in here], [g.name for g in here])
        threads.update({g.name: m + e for g, m, e in zip(here, mins, extra)})
    return threads, over


def plan(
    specs: Sequence[WorkerSpec], inventory: Inventory, usable_memory_fraction: float = 0.9
) -> Plan:
    """Place every worker or raise ``PlanError``; see the module docstring for the rules."""
    groups = _groups(specs)
    notes: list[str] = []
    if inventory.cpu_only:
        usable = int(inventory.host_memory_bytes * usable_memory_fraction)
        node_of = _cpu_nodes(groups, inventory, usable)
        slots: dict[str, list[GpuSlot]] = {}
    else:
        usable = int(inventory.gpu_memory_bytes * usable_memory_fraction)
        slots, notes = _gpu_slots(groups, inventory, usable)
        node_of = {g.name: (slots[g.name][0].node if g.name in slots else 0) for g in groups}
    threads, over = _threads(groups, node_of, inventory)
    if over:
        notes.append("more minimum threads than cores on a node: those workers time-share cores")
    total_cost = sum(g.cost for g in groups) or 1.0
    assignments = tuple(
        Assignment(
            worker=s.name,
            role=s.role,
            policy=s.policy,
            group=g.name,
            num_parameters=s.num_parameters,
            tokens_per_step=s.tokens_per_step,
            cost=s.cost,
            cost_share=s.cost / total_cost,
            memory_bytes=s.memory_bytes,
            node=node_of[g.name],
            gpus=tuple(slots.get(g.name, ())),
            threads=threads[g.name],
            ranks=s.ranks,
        )
        for g in groups
        for s in g.members
    )
    order = {s.name: i for i, s in enumerate(specs)}  # report in the caller's order
    assignments = tuple(sorted(assignments, key=lambda a: order[a.worker]))
    return Plan(
        inventory=inventory,
        mode="cpu" if inventory.cpu_only else "gpu",
        assignments=assignments,
        oversubscribed=over,
        notes=tuple(notes),
    )
