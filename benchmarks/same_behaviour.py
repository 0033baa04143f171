"""Does a change keep training bit for bit? Run the same jobs on two trees and compare.

For ``configs/default.toml`` and ``configs/tiny.toml`` under every registered strategy, a paced
run (``allocation.max_staleness = 1``) and a resumed run, each tree trains exactly as a user
would (``python -m mutualrl.cli train`` with the tree's own ``src`` first on ``PYTHONPATH``).
What must agree: every row of ``metrics.jsonl`` (timing keys aside: wall seconds and throughput
differ from run to run, and so does how a paced run's threads interleaved) and the experience
log record for record (kind, producer, sequence number, payload).

    python benchmarks/same_behaviour.py --base 31ac3ab            # base commit vs. this tree
    python benchmarks/same_behaviour.py --base HEAD~3 --only tiny  # the quick half

The base tree is checked out with ``git worktree`` into a temporary folder (removed afterwards);
the current tree is the working tree this script stands in. Exit 1 when anything differs, with
the first differing row. The base tree's fingerprints are kept under ``--work`` by commit and
job, so a base measured once is not trained again (``--work``, default under the system's temporary
folder).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Keys that measure the machine, not the training: wall seconds and throughput.
TIMING_SUFFIXES = ("time_s", "tokens_per_s")
STRATEGIES = ("none", "prp", "xgrpo", "sgt", "hacpo", "codistill", "hint")


def jobs(only: str | None, names: list[str] | None = None) -> list[tuple[str, list[str]]]:
    """The jobs to run: all, one config's (``only``), or the named ones."""
    return [j for j in all_jobs(only) if not names or j[0] in names]


def all_jobs(only: str | None) -> list[tuple[str, list[str]]]:
    """(name, train arguments) of every job; a resumed run is two invocations, marked by
    'resume'."""
    out: list[tuple[str, list[str]]] = []
    for config in ("tiny", "default"):
        if only and only != config:
            continue
        for s in STRATEGIES:
            out.append((f"{config}-{s}", ["--config", f"configs/{config}.toml", "--strategy", s]))
    if only in (None, "default"):
        # A paced run (each policy at its own pace, one step ahead at most): under `none` what
        # it computes does not depend on how the two policies' threads interleave.
        out.append(
            (
                "default-paced",
                [
                    "--config",
                    "configs/default.toml",
                    "--strategy",
                    "none",
                    "--set",
                    "allocation.max_staleness=1",
                ],
            )
        )
        # A resumed run: 5 steps with a checkpoint every 2, then --resume from step 4.
        out.append(
            (
                "default-resume",
                [
                    "--config",
                    "configs/default.toml",
                    "--steps",
                    "5",
                    "--set",
                    "save_steps=2",
                    "--set",
                    "warmup.max_steps=30",
                    "--set",
                    "eval.every=2",
                    "--set",
                    "eval.num_prompts=4",
                ],
            )
        )
    return out


def strip_timing(row: dict) -> dict:
    return {
        k: v
        for k, v in row.items()
        if not (k.endswith(TIMING_SUFFIXES) or k.startswith("phase/")) or k == "phase"
    }


def fingerprint(run_dir: Path, src: Path) -> dict:
    """Metrics rows without timing keys, and the experience log as (kind, producer, seq, digest)."""
    code = (
        "import json, sys, hashlib, msgspec\n"
        "from mutualrl.exchange import read_log\n"
        "rows = [(d.kind, d.producer, d.producer_version, d.seq,\n"
        "         hashlib.sha256(msgspec.msgpack.encode(d.record)).hexdigest())\n"
        "        for d in read_log(sys.argv[1])]\n"
        "print(json.dumps(rows))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(src))
    log = subprocess.run(
        [sys.executable, "-c", code, str(run_dir)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout
    # the run's own folder appears in resume rows; the two trees train into different folders
    text = (run_dir / "metrics.jsonl").read_text().replace(str(run_dir), "RUN_DIR")
    metrics = [strip_timing(json.loads(line)) for line in text.splitlines() if line.strip()]
    return {"metrics": metrics, "experience": json.loads(log)}


def run_tree(
    tree: Path,
    work: Path,
    only: str | None,
    cache: Path | None = None,
    names: list[str] | None = None,
) -> dict[str, dict]:
    """Train every job on ``tree``; returns each job's fingerprint. With ``cache``, a job whose
    fingerprint is stored there (``<job>.json``) is not trained again, and new ones are stored."""
    env = dict(os.environ, PYTHONPATH=str(tree / "src"), PYTHONHASHSEED="0")
    results = {}
    for name, args in jobs(only, names):
        stored = cache / f"{name}.json" if cache is not None else None
        if stored is not None and stored.exists():
            results[name] = json.loads(stored.read_text())
            continue
        out = work / name
        base = [
            sys.executable,
            "-m",
            "mutualrl.cli",
            "train",
            "--no-progress",
            "--output-dir",
            str(out),
        ]
        print(f"  {tree.name}: {name}", flush=True)
        subprocess.run(["rm", "-rf", str(out)], check=True)
        done = subprocess.run(base + args, cwd=tree, env=env, capture_output=True, text=True)
        if done.returncode == 0 and name.endswith("-resume"):
            done = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "mutualrl.cli",
                    "train",
                    "--no-progress",
                    "--resume",
                    str(out),
                ],
                cwd=tree,
                env=env,
                capture_output=True,
                text=True,
            )
        if done.returncode != 0:
            raise SystemExit(f"{tree}: job {name} failed:\n{done.stderr[-3000:]}")
        results[name] = fingerprint(out, tree / "src")
        if stored is not None:
            stored.parent.mkdir(parents=True, exist_ok=True)
            stored.write_text(json.dumps(results[name]))
    return results


# Keys of a paced run's rows that say how its policies' threads interleaved, not what it
# trained: how far ahead a policy started, which peer records had arrived or were dropped as
# stale, and the exchange's counters when the row was written (the peer may have published
# more by then).
INTERLEAVING = (
    "pace/lead",
    "pace/experience_records",
    "pace/experience_lag_mean",
    "pace/experience_lag_max",
    "pace/stale_dropped",
)


def comparable(row, paced: bool = False):
    """A metrics row as compared: a resume row's count of moved-aside record bytes measures the
    text of the moved rows, wall-clock values included, so it differs between any two runs; a
    paced row's interleaving keys differ as its threads' timing does."""
    if isinstance(row, dict) and row.get("phase") == "resume" and "moved_aside" in row:
        row = {
            **row,
            "moved_aside": {k: v for k, v in row["moved_aside"].items() if k != "record_bytes"},
        }
    if paced and isinstance(row, dict):
        row = {
            k: v
            for k, v in row.items()
            if not (k.endswith(INTERLEAVING) or k.startswith("exchange/"))
        }
    return row


def first_difference(a: dict, b: dict, paced: bool = False) -> str | None:
    """The first row that differs (None: none). ``paced``: the experience log compared by
    producer and sequence number, since the policies' threads append to it as they go."""
    a = {**a, "metrics": [comparable(r, paced) for r in a["metrics"]]}
    b = {**b, "metrics": [comparable(r, paced) for r in b["metrics"]]}
    if paced:
        a["experience"], b["experience"] = sorted(a["experience"]), sorted(b["experience"])
    for part in ("metrics", "experience"):
        if len(a[part]) != len(b[part]):
            return f"{part}: {len(a[part])} rows vs {len(b[part])}"
        for i, (x, y) in enumerate(zip(a[part], b[part])):
            if x != y:
                if isinstance(x, dict):
                    keys = sorted(k for k in set(x) | set(y) if x.get(k) != y.get(k))
                    return f"{part} row {i}: " + ", ".join(
                        f"{k}: {x.get(k)!r} vs {y.get(k)!r}" for k in keys[:5]
                    )
                return f"{part} row {i}: {x} vs {y}"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="git ref of the tree to compare against")
    ap.add_argument("--only", choices=("tiny", "default"), help="only this config's jobs")
    ap.add_argument(
        "--job",
        action="append",
        default=[],
        help="only these jobs (repeatable), e.g. --job default-resume",
    )
    ap.add_argument(
        "--work",
        default=str(Path(tempfile.gettempdir()) / "mutualrl-same-behaviour"),
        help="where runs and cached fingerprints go",
    )
    args = ap.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(
        ["git", "rev-parse", args.base], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        base_tree = Path(tmp) / f"base-{commit[:8]}"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(base_tree), commit],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        try:
            print(f"base {commit[:8]}:", flush=True)
            base = run_tree(
                base_tree,
                work / commit,
                args.only,
                cache=work / f"{commit}.fingerprints",
                names=args.job,
            )
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=ROOT)
    print("this tree:", flush=True)
    head = run_tree(ROOT, work / "head", args.only, names=args.job)
    bad = 0
    for name in head:
        diff = first_difference(base[name], head[name], paced="paced" in name)
        print(f"{name:20s} {'identical' if diff is None else 'DIFFERS: ' + diff}")
        bad += diff is not None
    digest = hashlib.sha256(json.dumps(head, sort_keys=True).encode()).hexdigest()[:16]
    print(f"{len(head) - bad}/{len(head)} jobs identical (this tree's fingerprint {digest})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
