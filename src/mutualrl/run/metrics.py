"""Per-step metrics: namespaced keys (``policy/<name>/reward/mean``) appended as JSON lines.

Each line goes to disk as soon as it is written, whole or not at all (``storage.append_whole``),
so an interrupted or failing run keeps every step it finished and never leaves a torn line.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from mutualrl.run.jsonl import read_jsonl
from mutualrl.storage import append_whole


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN; null says "not a number" without breaking readers
    return value


class MetricsWriter:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, record: dict[str, Any]) -> None:
        if self._fd is None:
            raise ValueError(f"{self.path}: written to after close")
        line = json.dumps({k: _clean(v) for k, v in record.items()}) + "\n"
        append_whole(
            self._fd,
            line.encode("utf-8"),
            self.path,
            f"this record ({record.get('phase')} step {record.get('step')}) was not "
            "written; every record before it is kept",
        )

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Every record of ``path``; a damaged line is an error naming the file and byte offset."""
    return read_jsonl(path)


def namespaced(policy: str, stats: dict[str, float], prefix: str = "") -> dict[str, float]:
    return {f"policy/{policy}/{prefix}{k}": v for k, v in stats.items()}
