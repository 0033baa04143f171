"""``mutualrl plan``'s arguments and its output: the resource plan of a run config as a table
or JSON. The command itself (``run.plan_cli``) runs the run's input checks first."""

from __future__ import annotations

import argparse
from typing import Literal

from mutualrl.allocation.planner import Assignment, GpuSlot, Plan
from mutualrl.config import GIB


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        required=True,
        help="TOML run config file, or a packaged config's name (mutualrl configs list)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="dotted override, e.g. --set allocation.inventory.nodes=4 (repeatable)",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON instead")


def format_devices(gpus: tuple[GpuSlot, ...]) -> str:
    """``n0:g0-3``, ``n0:g2 (40%)``, ``n0:g6-7 + n1:g0-1``; ``cpu`` when there are none."""
    if not gpus:
        return "cpu"
    by_node: dict[int, list[GpuSlot]] = {}
    for s in gpus:
        by_node.setdefault(s.node, []).append(s)
    parts = []
    for node, slots in sorted(by_node.items()):
        idx = sorted(s.gpu for s in slots)
        contiguous = idx == list(range(idx[0], idx[-1] + 1))
        span = (
            f"g{idx[0]}-{idx[-1]}"
            if contiguous and len(idx) > 1
            else ",".join(f"g{i}" for i in idx)
        )
        frac = slots[0].fraction
        parts.append(f"n{node}:{span}" + (f" ({frac:.0%})" if frac < 1 else ""))
    return " + ".join(parts)


def _params(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def _row(a: Assignment) -> list[str]:
    return [
        a.worker,
        a.role,
        a.policy or "-",
        _params(a.num_parameters) if a.num_parameters else "-",
        f"{a.tokens_per_step:,}",
        f"{a.cost_share:.1%}",
        format_devices(a.gpus),
        str(a.threads) if a.threads else "driver",
        _memory(a),
    ]


def _memory(a: Assignment) -> str:
    """Per GPU and on how many for a worker of several ranks (``8.00 GiB x 4``)."""
    each = f"{a.memory_bytes / GIB:.2f} GiB"
    return f"{each} x {a.ranks}" if a.ranks and a.ranks > 1 else each


def plan_table(p: Plan):
    """The plan as a rich Table (one row per worker)."""
    from rich.table import Table

    inv = p.inventory
    what = (
        f"{inv.nodes} node(s) x {inv.gpus_per_node} GPU(s) of {inv.gpu_memory_bytes / GIB:.0f} GiB"
        if inv.gpus_per_node
        else f"{inv.nodes} node(s), CPU only, {inv.host_memory_bytes / GIB:.0f} GiB RAM"
    )
    table = Table(title=f"plan ({p.mode}): {what}, {inv.cpus_per_node} cores/node ({inv.source})")
    columns: tuple[tuple[str, Literal["left", "right"]], ...] = (
        ("worker", "left"),
        ("role", "left"),
        ("policy", "left"),
        ("params", "right"),
        ("tokens/step", "right"),
        ("cost share", "right"),
        ("devices", "left"),
        ("threads", "right"),
        ("memory", "right"),
    )
    for col, justify in columns:
        table.add_column(col, justify=justify)
    for a in p.assignments:
        table.add_row(*_row(a))
    return table


def config_plan(cfg) -> Plan:
    """The plan from the config alone (its sizes, its described inventory): what ``mutualrl plan``
    shows for a machine other than this one."""
    import msgspec

    from mutualrl.allocation.planner import plan
    from mutualrl.allocation.specs import resolve_inventory, worker_specs_from_config
    from mutualrl.policies.precision import precision_notes

    alloc = cfg.allocation
    specs = worker_specs_from_config(cfg, alloc)
    p = plan(specs, resolve_inventory(alloc), alloc.memory.usable_memory_fraction)
    return msgspec.structs.replace(p, notes=p.notes + precision_notes(cfg))


def show_plan(cfg, p: Plan, as_json: bool = False) -> None:
    """Print the plan: a table and its notes, or (``as_json``) the plan as JSON."""
    import msgspec
    from rich.console import Console

    if as_json:
        print(msgspec.json.format(msgspec.json.encode(p).decode()))
        return
    # Piped output defaults to 80 columns, which would elide worker names; tables need ~140.
    console = Console(width=max(Console().width, 150))
    console.print(plan_table(p))
    for note in p.notes:
        console.print(f"note: {note}")
    caps = memory_caps(cfg, p)
    if caps:
        console.print(
            "note: processes that share a GPU are capped at their planned memory over "
            "usable_memory_fraction (allocation.memory.cap_shared_gpus): "
            + ", ".join(f"{name} {cap / GIB:.2f} GiB" for name, cap in caps.items())
        )


def memory_caps(cfg, p: Plan) -> dict[str, int]:
    """The GPU memory cap of each policy's process that the run would set (``process_memory_cap``
    on the device ``policy_device`` gives it, as the run's build asks)."""
    from mutualrl.allocation.placement import policy_device, process_memory_cap

    alloc = cfg.allocation
    caps = {
        q.name: process_memory_cap(
            q.name, policy_device(q.name, cfg.device, p, alloc.executor), p, alloc
        )
        for q in cfg.policies
    }
    return {name: cap for name, cap in caps.items() if cap is not None}
