"""Resuming a run folder from a checkpoint (``mutualrl train --resume RUN_DIR``), in one call.

``open_checkpoint`` finds the newest complete checkpoint (``checkpoint.latest``), refuses a
config that differs from the checkpoint's in what the run computes (``check_config``; the
``HARMLESS`` fields may change), refuses record files shorter than the checkpoint recorded
(``check_lengths``, ``jsonl.check_records``), then cuts the run's files back to it, moving what
follows aside (``cut_back``): all before anything is written. ``resume_from`` loads it into the
freshly built run. What a checkpoint holds and how it is written: ``run.checkpoint``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mutualrl.config import ConfigError, RunConfig, config_from_dict, to_dict
from mutualrl.run.checkpoint import APPEND_ONLY, CHECKPOINT_DIR, Checkpoint, latest, restore
from mutualrl.run.jsonl import check_records

if TYPE_CHECKING:
    from mutualrl.run.state import Run

# Config paths a resumed run may change: they decide how long and how visibly a run goes on.
# Anything else that differs is refused. Two of them also change what follows, and a resume says
# so (``resume_notes``): evaluations draw from each policy's sampler, so ``eval`` moves the
# training samples after the next evaluation; and a learning-rate schedule spans the run's
# ``steps``, so a schedule other than constant takes the new horizon (as transformers' Trainer
# does when a resumed run's max_steps changes).
HARMLESS = (
    "steps",
    "output_dir",
    "eval",
    "save_steps",
    "save_total_limit",
    "report_to",
    "guards",
    "warmup.cache_dir",
    "allocation.call_timeout_s",
    "allocation.placement_timeout_s",
    "exchange.block_timeout_s",
    "allocation.process_group_timeout_s",
    "allocation.master_port",
    # where the workers run, not what they compute (every executor gives the same numbers)
    "allocation.executor",
    "allocation.local_mode",
)
# Per-policy paths (``policies.<i>.<path>``) a resumed run may change: how many ranks a learner is
# sharded over (its checkpoint reshards on load; sums over ranks differ from one rank's only by
# float rounding) and where its shards are kept.
POLICY_HARMLESS = ("learner_ranks", "sharding.cpu_offload")


def open_checkpoint(cfg: RunConfig, found: Checkpoint | None = None) -> tuple[Checkpoint, dict]:
    """The checkpoint a resumed run continues from (``found``: already found and verified),
    checked against ``cfg`` before anything is written; then the run's files are cut back to it
    (what follows is moved aside, not lost)."""
    notes: list[str] = []
    ckpt = found or latest(Path(cfg.output_dir), report=notes.append)
    for line in notes:
        print(f"mutualrl: {line}", file=sys.stderr)
    if ckpt is None:
        raise ConfigError(
            "--resume: no complete checkpoint in "
            f"{Path(cfg.output_dir) / CHECKPOINT_DIR} "
            "(checkpoints are written every save_steps steps; save_steps = 0 writes none)"
        )
    harmless = check_config(ckpt, cfg)
    check_lengths(Path(cfg.output_dir), ckpt)
    check_records(Path(cfg.output_dir), ckpt.state.get("append_only", {}), ckpt.path.name)
    print(f"mutualrl: resuming from {ckpt.path} (after step {ckpt.step})", file=sys.stderr)
    changes = resume_notes(harmless, cfg)
    for line in changes:
        print(f"mutualrl: note: {line}", file=sys.stderr)
    moved = cut_back(Path(cfg.output_dir), ckpt)
    return ckpt, {
        "phase": "resume",
        "step": ckpt.step,
        "checkpoint": str(ckpt.path),
        "skipped_checkpoints": notes,
        "changed_harmless": harmless,
        "changes_what_follows": changes,
        "moved_aside": moved,
    }


def resume_from(run: Run, ckpt: Checkpoint, record: dict) -> int:
    """Load the checkpoint into the freshly built run; returns the next step."""
    start = restore(run, ckpt)
    run.writer.write(record)
    return start


def config_differences(old: dict, new: dict) -> tuple[list[str], list[str]]:
    """(refused, harmless) dotted paths where two resolved configs differ."""
    a, b = _flatten(old), _flatten(new)
    changed = sorted(k for k in a.keys() | b.keys() if a.get(k, _MISSING) != b.get(k, _MISSING))
    harmless = [
        k
        for k in changed
        if any(k == h or k.startswith(h + ".") for h in HARMLESS)
        or (k.startswith("policies.") and k.split(".", 2)[-1] in POLICY_HARMLESS)
    ]
    return [k for k in changed if k not in harmless], harmless


_MISSING = object()


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    items: Iterable[tuple[Any, Any]]
    if isinstance(d, dict):
        items = d.items()
    elif isinstance(d, list) and d and all(isinstance(x, dict) for x in d):
        items = ((str(i), x) for i, x in enumerate(d))
    else:
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in items:
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def resume_notes(harmless: list[str], cfg) -> list[str]:
    """What the accepted changes ``harmless`` change in the continued run (see ``HARMLESS``)."""
    notes = []
    evals = [k for k in harmless if k == "eval" or k.startswith("eval.")]
    if evals:
        notes.append(
            f"{', '.join(evals)} changed: evaluations sample from each policy's own "
            "generator, so the training samples after the next evaluation differ from "
            "those of a run continued with the checkpoint's settings"
        )
    if "steps" in harmless and cfg.training.lr_scheduler_type != "constant":
        notes.append(
            f"steps changed: the learning-rate schedule "
            f"(training.lr_scheduler_type = {cfg.training.lr_scheduler_type!r}) now spans "
            f"the run's {cfg.steps} steps, from the checkpoint's position in it"
        )
    return notes


def check_config(ckpt: Checkpoint, cfg) -> list[str]:
    """Refuse a config that differs in what matters (naming the fields); list harmless changes."""
    old = ckpt.state["config"]
    try:  # a checkpoint from before [allocation] and [scenarios] were typed holds only the
        old = to_dict(config_from_dict(old))  # fields the user wrote: fill in the defaults
    except ConfigError:
        pass
    refused, harmless = config_differences(old, to_dict(cfg))
    if refused:
        shown = ", ".join(refused[:8]) + (" ..." if len(refused) > 8 else "")
        raise ConfigError(
            f"--resume: the config differs from the checkpoint's ({ckpt.path}) in "
            f"what the run computes: {shown}; resume with the run's own config "
            f"(RUN_DIR/config.json) or start a new run"
        )
    return harmless


def check_lengths(run_dir: Path, ckpt: Checkpoint) -> None:
    """Every record file and log segment must still hold what it held at the checkpoint: one that
    is shorter (cut, or torn by a full disk) lost records the run had written, and continuing
    would leave a gap. Refused, naming the file and the byte offsets."""
    run_dir = Path(run_dir)
    recorded = [(run_dir / n, size) for n, size in ckpt.state["append_only"].items()]
    recorded += [(run_dir / "experience" / n, size) for n, size in ckpt.state["segments"].items()]
    for path, size in recorded:
        have = path.stat().st_size if path.is_file() else None
        if have is None and size > 0:
            problem = "is missing"
        elif have is not None and have < size:
            problem = (
                f"is {have} bytes where the checkpoint recorded {size}: bytes {have}-{size}, "
                "written before the checkpoint, are gone"
            )
        else:
            continue
        raise ConfigError(
            f"--resume: {path} {problem} (checkpoint {ckpt.path.name}); the run "
            "cannot continue without a gap in its records. Restore the file, or "
            "start afresh with --overwrite"
        )


def cut_back(run_dir: Path, ckpt: Checkpoint) -> dict[str, int]:
    """Cut metrics and the experience log back to the checkpoint, moving what follows aside."""
    run_dir = Path(run_dir)
    moved = {"record_bytes": 0, "log_bytes": 0, "segments": 0}
    for name in APPEND_ONLY:
        path, keep = run_dir / name, ckpt.state["append_only"].get(name, 0)
        if path.is_file() and path.stat().st_size > keep:
            moved["record_bytes"] += _move_tail(path, keep, discarded_path(path))
    seg_dir = run_dir / "experience"
    sizes = ckpt.state["segments"]
    for seg in sorted(seg_dir.glob("*.mrlx")) if seg_dir.is_dir() else ():
        aside = seg_dir / "discarded" / seg.name
        if seg.name not in sizes:  # written after the checkpoint
            aside.parent.mkdir(exist_ok=True)
            moved["log_bytes"] += seg.stat().st_size
            os.replace(seg, aside)
            moved["segments"] += 1
        elif seg.stat().st_size > sizes[seg.name]:
            moved["log_bytes"] += _move_tail(seg, sizes[seg.name], aside)
    return moved


def discarded_path(path: Path) -> Path:
    """Where the part of an append-only file after a checkpoint goes:
    ``metrics.discarded.jsonl``."""
    return path.with_name(f"{path.stem}.discarded{path.suffix}")


def _move_tail(path: Path, keep: int, aside: Path) -> int:
    """Append ``path``'s bytes past ``keep`` to ``aside`` (fsynced), then truncate ``path``."""
    aside.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "rb") as f:
        f.seek(keep)
        tail = f.read()
    with open(aside, "ab") as f:
        f.write(tail)
        f.flush()
        os.fsync(f.fileno())
    with open(path, "r+b") as f:
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())
    return len(tail)
