"""Step time, tokens/s and peak GPU memory of `mutualrl train` runs, from their own logs.

Reads each RUN_DIR's ``metrics.jsonl`` and ``summary.json`` (what any run writes) and, where given,
a GPU memory trace polled beside the run (``nvidia-smi --query-gpu=memory.used`` and
``--query-compute-apps=pid,used_memory``, CSV without header or units, one file each). Medians
over the GRPO steps after the first (the first pays CUDA's lazy initialisation and the allocator's
growth); torch's own peak memory counters (``cuda/peak_*_gib``, ``cuda/alloc_retries``) as their
largest over the run. A run stopped before its end is summarised from the steps it logged
(``finished``:
false); one that logged none gets an ``error``. ``benchmarks/gpu_check.sh`` calls it; it runs
anywhere the run folders are.

    python benchmarks/gpu_run_summary.py --run paced=/tmp/gpu-paced --smi paced=smi.csv \
        --apps paced=apps.csv --json gpu_run.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from mutualrl.run.metrics import read_metrics

PER_POLICY = (
    "step_time_s",
    "tokens_per_s",
    "completion_length",
    "phase/generate_time_s",
    "phase/update_time_s",
    "pace/step_wall_time_s",
    "pace/gate_wait_time_s",
)
# torch.cuda's own peaks, reported with each update (policies.device_memory), and the cap of a
# process that shares its GPU (allocation.memory.cap_shared_gpus)
PEAKS = (
    "cuda/peak_allocated_gib",
    "cuda/peak_reserved_gib",
    "cuda/alloc_retries",
    "cuda/memory_cap_gib",
)


def median_after_first(values: list[float]) -> float | None:
    kept = values[1:] or values
    return statistics.median(kept) if kept else None


def summarise(run: Path) -> dict:
    """One run's medians; an ``error`` entry where it logged no GRPO step (the other runs of the
    check are still summarised)."""
    if not (run / "metrics.jsonl").exists():
        return {"run": str(run), "error": "no metrics.jsonl: the run logged nothing"}
    train = [r for r in read_metrics(run / "metrics.jsonl") if r.get("phase") == "train"]
    if not train:
        return {
            "run": str(run),
            "error": "no GRPO step in metrics.jsonl (see the run's log and failures.jsonl)",
        }
    path = run / "summary.json"  # absent where the run was stopped before its end
    summary = json.loads(path.read_text()) if path.exists() else {}
    names = sorted({k.split("/")[1] for r in train for k in r if k.startswith("policy/")})
    policies = {}
    for name in names:
        entry = {}
        for stat in PER_POLICY:
            values = [r[f"policy/{name}/{stat}"] for r in train if f"policy/{name}/{stat}" in r]
            if values:
                entry[stat] = median_after_first(values)
        for stat in PEAKS:  # the largest over the run, the first step included
            values = [r[f"policy/{name}/{stat}"] for r in train if f"policy/{name}/{stat}" in r]
            if values:
                entry[f"{stat}_max"] = max(values)
        entry["steps"] = sum(f"policy/{name}/step_time_s" in r for r in train)
        policies[name] = entry
    step_wall = [r["time_s"] for r in train if "time_s" in r]
    phases = {
        k: median_after_first([r[k] for r in train if k in r])
        for k in sorted({k for r in train for k in r if k.startswith("phase/")})
    }
    return {
        "run": str(run),
        "finished": path.exists(),
        "steps": len(train),
        "step_wall_s_median": median_after_first(step_wall),
        "phase_medians_s": phases,
        "wall_time_s": summary.get("wall_time_s"),
        "phase_times_s": summary.get("phase_times_s"),
        "policies": policies,
    }


def peak_mib(path: Path) -> float | None:
    """The largest reading of a one-column trace (``memory.used``, MiB)."""
    values = []
    for line in path.read_text().splitlines():
        try:
            values.append(float(line.strip()))
        except ValueError:  # a line cut short when the poller was stopped
            continue
    return max(values) if values else None


def per_process_peak_mib(path: Path) -> dict[str, float]:
    peaks: dict[str, float] = {}
    for line in path.read_text().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2:
            try:
                peaks[parts[0]] = max(peaks.get(parts[0], 0.0), float(parts[1]))
            except ValueError:
                continue
    return peaks


def labelled(items: list[str] | None) -> dict[str, Path]:
    out = {}
    for item in items or ():
        label, sep, path = item.partition("=")
        if not sep:
            raise SystemExit(f"{item!r}: expected LABEL=PATH")
        out[label] = Path(path)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--run", action="append", required=True, help="LABEL=RUN_DIR (repeatable)")
    ap.add_argument("--smi", action="append", help="LABEL=CSV of nvidia-smi memory.used (MiB)")
    ap.add_argument("--apps", action="append", help="LABEL=CSV of nvidia-smi pid,used_memory (MiB)")
    ap.add_argument("--device", default="", help="the machine, in words (recorded as given)")
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    smi, apps = labelled(args.smi), labelled(args.apps)
    out = {"device": args.device, "runs": {}}
    for label, run in labelled(args.run).items():
        entry = summarise(run)
        if label in smi and smi[label].exists():
            entry["gpu_memory_used_peak_mib"] = peak_mib(smi[label])
        if label in apps and apps[label].exists():
            entry["gpu_memory_per_process_peak_mib"] = per_process_peak_mib(apps[label])
        out["runs"][label] = entry
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
