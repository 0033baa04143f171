"""Per-step metrics: namespaced keys (``policy/<name>/reward/mean``) appended as JSON lines.

Each line is flushed as soon as it is written, so an interrupted or failing run keeps every step
it finished.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN; null says "not a number" without breaking readers
    return value


class MetricsWriter:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def namespaced(policy: str, stats: dict[str, float], prefix: str = "") -> dict[str, float]:
    return {f"policy/{policy}/{prefix}{k}": v for k, v in stats.items()}
