"""One JSON per benchmark in ``benchmarks/results/``: a benchmark measured on several subjects
(models, tokenizers) keeps one run per subject in one file, ``{"runs": [...]}``, each run with
its own ``label``, commit, machine and command, so rerunning one subject replaces only its run."""

from __future__ import annotations

import json
from pathlib import Path


def write_run(path: Path, record: dict) -> dict:
    """Write ``record`` (which has a ``label``) to ``path``: into a file of several runs, in
    place of the run with the same label, the others kept; anywhere else, as the whole file.
    Returns what was written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(path.read_text()) if path.exists() else None
    if isinstance(old, dict) and isinstance(old.get("runs"), list):
        kept = [r for r in old["runs"] if r["label"] != record["label"]]
        record = {**old, "runs": [*kept, record]}
    path.write_text(json.dumps(record, indent=2) + "\n")
    return record
