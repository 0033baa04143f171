"""``mutualrl plan``: the resource plan of a run config, writing nothing.

For this machine (``allocation.inventory`` detected) it runs the same input checks as ``mutualrl
train`` first (``run.build.prepare`` with ``planning=True``): a bad name, a checkpoint folder that
cannot be read, a chat template the sandbox refuses or a data file that is not there is the one
line ``train`` would give, so a config that plans here starts here. For a described inventory (a
cluster's ``[allocation.inventory]``), the checkpoints and data live on the machine that trains:
the plan comes from the config alone (``allocation.cli.config_plan``), and a note says that the
file checks run there.
"""

from __future__ import annotations

from mutualrl.allocation.cli import config_plan, configure, show_plan

__all__ = ["configure", "run"]

ELSEWHERE = (
    "planned for the described allocation.inventory: the checks of the config's checkpoints, "
    "data and devices run where it trains (`mutualrl train`)"
)


def run(args) -> int:
    import msgspec

    from mutualrl.allocation.specs import resolve_inventory
    from mutualrl.config import load_config
    from mutualrl.policies.model_cache import LineStages, resolve_policies
    from mutualrl.policies.precision import resolve_precision
    from mutualrl.run.build import prepare

    cfg = load_config(args.config, list(args.set))
    # a packaged model's dims are in its converted folder (converted now if it is not yet)
    cfg = msgspec.structs.replace(cfg, policies=resolve_policies(cfg.policies, LineStages()))
    cfg = resolve_precision(cfg)  # what dtype = "auto" chooses on this machine
    if resolve_inventory(cfg.allocation).source == "detected":
        p = prepare(cfg, planning=True).plan
    else:
        p = config_plan(cfg)
        p = msgspec.structs.replace(p, notes=(*p.notes, ELSEWHERE))
    show_plan(cfg, p, args.json)
    return 0
