"""Experiment trackers (``report_to``): every metric record also goes to TensorBoard or W&B.

``metrics.jsonl`` stays the source of truth; trackers are views of it. ``TrackedWriter`` wraps the
run's ``MetricsWriter`` so the loop keeps one call per record: each numeric value of a ``train``
or ``eval`` record is logged as a scalar named by its metric key (``policy/<name>/reward/mean``;
eval keys get an ``eval/`` prefix so held-out curves sit apart) at x = the record's step. Warm-start
records are logged under ``warmup/`` at their own step. Trackers are optional packages: a missing
one fails in ``check_trackers``, before any training work, naming ``report_to`` and the pip command.
"""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path
from typing import Any, Protocol

from mutualrl.config import ConfigError
from mutualrl.registry import Registry
from mutualrl.run.metrics import MetricsWriter


class Tracker(Protocol):
    def log(self, scalars: dict[str, float], step: int) -> None: ...
    def close(self) -> None: ...


class TensorBoardTracker:
    """Event files under ``<output_dir>/tensorboard/`` (``tensorboard --logdir RUN_DIR``)."""

    module = "tensorboard"

    def __init__(self, out: Path, run_name: str, config: dict) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(out / "tensorboard"))

    def log(self, scalars: dict[str, float], step: int) -> None:
        for key, value in scalars.items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    """A W&B run in ``<output_dir>/wandb/`` of project ``mutualrl``; offline unless ``WANDB_MODE``
    says otherwise, since a training machine often has no network (``wandb sync`` uploads it)."""

    module = "wandb"

    def __init__(self, out: Path, run_name: str, config: dict) -> None:
        import wandb

        self._run = wandb.init(
            dir=str(out),
            project="mutualrl",
            name=run_name,
            config=config,
            mode=os.environ.get("WANDB_MODE", "offline"),
        )

    def log(self, scalars: dict[str, float], step: int) -> None:
        self._run.log(scalars, step=step)

    def close(self) -> None:
        self._run.finish()


TRACKERS: Registry = Registry("tracker")
TRACKERS.register("tensorboard")(TensorBoardTracker)
TRACKERS.register("wandb")(WandbTracker)


def check_trackers(report_to: list[str]) -> None:
    """Fail before training if a tracker is unknown or its package is not installed."""
    for name in report_to:
        if name not in TRACKERS.names():
            raise ConfigError(
                f"report_to: unknown tracker {name!r}; registered: {TRACKERS.names()}"
            )
        if importlib.util.find_spec(TRACKERS.get(name).module) is None:
            raise ConfigError(
                f"report_to: {name!r} needs the {TRACKERS.get(name).module} package; "
                f"install it with pip install mutualrl[{name}]"
            )


def scalars_of(record: dict[str, Any]) -> tuple[dict[str, float], int] | None:
    """(scalars, step) a record contributes to trackers, or None for records without a step."""
    step = record.get("step")
    if not isinstance(step, int):
        return None
    prefix = {"train": "", "eval": "eval/"}.get(str(record.get("phase")), "warmup/")
    scalars = {
        prefix + k: float(v)
        for k, v in record.items()
        if k not in ("phase", "step")
        and isinstance(v, (int, float))
        and not isinstance(v, bool)
        and math.isfinite(v)
    }
    return scalars, step


class TrackedWriter(MetricsWriter):
    """A ``MetricsWriter`` that also sends every record it writes to the run's trackers."""

    def __init__(self, path: str | Path, trackers: list[Tracker]) -> None:
        super().__init__(path)
        self.trackers = trackers

    def write(self, record: dict[str, Any]) -> None:
        super().write(record)
        found = scalars_of(record)
        if found and found[0]:
            for tracker in self.trackers:
                tracker.log(*found)

    def close(self) -> None:
        super().close()
        for tracker in self.trackers:
            tracker.close()


def make_writer(path: Path, report_to: list[str], run_name: str, config: dict) -> MetricsWriter:
    """The run's metric writer: the plain one when ``report_to`` is empty (nothing changes)."""
    if not report_to:
        return MetricsWriter(path)
    check_trackers(report_to)
    trackers = [TRACKERS.get(name)(path.parent, run_name, config) for name in report_to]
    return TrackedWriter(path, trackers)
