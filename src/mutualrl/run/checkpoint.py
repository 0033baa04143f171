"""Run checkpoints: everything a run's future depends on, written atomically, and resuming from one.

A checkpoint is taken between steps (the loop's ``save`` phase, every ``save_steps`` steps) into
``RUN_DIR/checkpoints/step-NNNNNN/``:

* ``policies/<name>/``  each policy's ``save_checkpoint``: weights, optimizer (and scheduler)
  state, sampler generator, version, skipped-step count, and the frozen KL reference — written by
  the worker that holds the policy, wherever it lives (the path must be visible to it); tensors
  and plain values only, read back with ``torch.load(weights_only=True)``;
* ``strategy.msgpack``  the strategy's ``state_dict()`` (e.g. SGT's success buffer), if it has one;
* ``run.msgpack``       the next step, reward history, phase times, verifier counters, policy
  versions, the exchange bus's numbering, counters and still-queued deliveries, the byte length
  of the append-only record files (``metrics.jsonl``, ``heldout.jsonl``) and of every
  experience-log segment at that moment, global RNG states, and the resolved config;
* ``manifest.json``     written last: format, step and the sha256 of every file above.

Data, never code: the two state files are MessagePack with a format version (``run.state_codec``):
records go through the exchange's own codec as registered experience kinds, tensors and numpy
arrays as dtype, shape and bytes. Nothing in a checkpoint is unpickled beyond what
``weights_only`` allows, so resuming a folder someone else wrote runs none of their code. A
checkpoint of the older pickle format (``run.pkl``) is refused, not read.

Atomic: everything is written into a temporary directory, fsynced, the manifest last, then the
directory is renamed into place — a checkpoint is complete or invisible. A checkpoint whose
manifest is missing, whose checksums do not match, or one of whose files does not load (a manifest
can be recomputed over a damaged file) is reported and skipped for the previous one. The newest
``save_total_limit`` complete checkpoints are kept (default 2; 0 or None: all).

Resuming (``mutualrl train --resume RUN_DIR``) cuts the run's files back to the checkpoint before
anything else is written: rows of ``metrics.jsonl`` (and ``heldout.jsonl``) after it move to
``metrics.discarded.jsonl`` (``heldout.discarded.jsonl``)
and experience-log bytes after it (frames of the unfinished step, a torn frame) move to
``experience/discarded/``, so nothing is lost and replay needs no special case: the resumed run
writes a new segment and continues every producer's sequence numbers where they stopped.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mutualrl.config import ConfigError, to_dict
from mutualrl.policies.worker import RestoreCheckpoint, SaveCheckpoint
from mutualrl.run import state_codec
from mutualrl.storage import disk_full, storage_error
from mutualrl.workers import call_each

if TYPE_CHECKING:
    from mutualrl.run.state import Run

CHECKPOINT_DIR = "checkpoints"
MANIFEST = "manifest.json"
# 2: run and strategy state as data (run.state_codec). 1 held them as pickles, which run code when
# read: a checkpoint of format 1 (it has a run.pkl) is refused, never read.
FORMAT = 2
RUN_STATE = "run.msgpack"
STRATEGY_STATE = "strategy.msgpack"
PICKLED_STATE = "run.pkl"
PREFIX = "step-"
# What a run state must hold for the resume's checks to read it (the rest is checked on restore).
RUN_STATE_KEYS = {"step": int, "config": dict, "append_only": dict, "segments": dict}
# The run's append-only record files; a resumed run cuts each back to its size at the checkpoint.
APPEND_ONLY = ("metrics.jsonl", "heldout.jsonl")


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int
    state: dict[str, Any]  # run.msgpack, with strategy.msgpack as "strategy"


# ---- writing --------------------------------------------------------------------------------
def save(run: Run, step: int) -> Path:
    """Checkpoint the run after ``step`` steps; returns its directory."""
    root = run.out / CHECKPOINT_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{PREFIX}{step:06d}-", dir=root))
    try:
        run.bus.flush()  # the log on disk holds every record published so far
        names = run.live()
        saved = call_each(
            run.executor, {n: SaveCheckpoint(str(tmp / "policies" / n)) for n in names}
        )
        if set(saved) != set(names):
            raise RuntimeError(
                f"checkpoint at step {step}: saving {sorted(set(names) - set(saved))} failed"
            )
        state = _run_state(run, step)
        if "strategy" in state:
            _write(tmp / STRATEGY_STATE, state_codec.encode(state.pop("strategy"), "strategy"))
        _write(tmp / RUN_STATE, state_codec.encode(state, "run"))
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        for p in files:
            _fsync(p)
        manifest = {
            "format": FORMAT,
            "step": step,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "files": {str(p.relative_to(tmp)): _sha256(p) for p in files},
        }
        _write(tmp / MANIFEST, json.dumps(manifest, indent=2).encode())
        if final.exists():  # a checkpoint of this step from an earlier attempt
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
    except BaseException as exc:
        full = isinstance(exc, Exception) and disk_full(exc, tmp)  # before freeing what it wrote
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            raise storage_error(
                exc, final, _disk_full_advice(root, run.out, step), full=True
            ) from exc
        raise
    prune(root, run.cfg.save_total_limit)
    return final


def _disk_full_advice(root: Path, out: Path, step: int) -> str:
    """What to do after the disk filled while writing the checkpoint of ``step``: resume from
    an earlier complete checkpoint; with none, --resume has nothing to continue from, so the run
    starts again (--overwrite, since its folder holds its first records)."""
    lost = (
        f"the checkpoint at step {step} was not written (its partial files are removed); "
        "the run's records"
    )
    if any((p / MANIFEST).is_file() for p in _candidates(root)):
        return (
            f"{lost} and earlier checkpoints are kept: free space, then "
            f"`mutualrl train --resume {out}`"
        )
    return (
        f"{lost} are kept, but no checkpoint was completed, so there is nothing to resume: "
        "free space, then start the run again with the same `mutualrl train` command and "
        "--overwrite"
    )


def _run_state(run: Run, step: int) -> dict[str, Any]:
    """The run's ``state_dict`` and what the checkpoint adds: format, step, the resolved config,
    and the byte length of every append-only file at this moment (what a resume cuts back to)."""
    seg_dir = run.out / "experience"
    return {
        "format": FORMAT,
        "step": step,
        "config": to_dict(run.cfg),
        **run.state_dict(),
        "append_only": {
            name: (run.out / name).stat().st_size
            for name in APPEND_ONLY
            if (run.out / name).is_file()
        },
        "segments": {p.name: p.stat().st_size for p in sorted(seg_dir.glob("*.mrlx"))}
        if seg_dir.is_dir()
        else {},
    }


def prune(root: Path, limit: int | None) -> None:
    """Keep the newest ``limit`` complete checkpoints (None or 0: all); drop stale temporaries."""
    for tmp in root.glob(f".{PREFIX}*"):
        shutil.rmtree(tmp, ignore_errors=True)
    if not limit:
        return
    complete = [p for p in _candidates(root) if (p / MANIFEST).is_file()]
    for old in complete[:-limit]:
        shutil.rmtree(old, ignore_errors=True)


# ---- finding and checking ---------------------------------------------------------------------
def _candidates(root: Path) -> list[Path]:
    return sorted((p for p in root.glob(f"{PREFIX}*") if p.is_dir()), key=lambda p: p.name)


def verify(path: Path) -> str | None:
    """None if the checkpoint at ``path`` is complete and intact, else what is wrong with it."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        return "no manifest (the write did not finish)"
    except (OSError, json.JSONDecodeError) as exc:
        return f"unreadable manifest ({exc})"
    if manifest.get("format") != FORMAT:
        return f"format {manifest.get('format')!r}, this version reads {FORMAT}"
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return 'its manifest lists no files (expected a "files" table of name: sha256)'
    for name, digest in files.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if _sha256(f) != digest:
            return f"{name} does not match its checksum"
    return None


def latest(run_dir: Path, report=print) -> Checkpoint | None:
    """The newest complete, intact checkpoint of ``run_dir`` whose files all load; damaged ones
    are reported, skipped. A checkpoint of the pickle format (1) is refused: reading it could run
    code, and whoever can write the folder can also rewrite its manifest."""
    for path in reversed(_candidates(Path(run_dir) / CHECKPOINT_DIR)):
        if (path / PICKLED_STATE).exists():
            raise ConfigError(
                f"--resume: checkpoint {path} was written by an older version of "
                "mutualrl in a format that can run code when read (pickle), so it "
                "is not read; start afresh (--overwrite) or resume with the older "
                "version"
            )
        problem = verify(path)
        found = _load(path) if problem is None else None
        if isinstance(found, Checkpoint):
            return found
        report(f"checkpoint {path} skipped: {problem or found}; trying the previous one")
    return None


def _load(path: Path) -> Checkpoint | str:
    """The checkpoint at ``path`` (checksums verified) with its state decoded, or what fails
    to load: its state files, or a policy's file (read as data only, its tensors mapped, not
    read). A manifest can be recomputed over a damaged file, so checksums alone do not say it."""
    try:
        state = _decode(path / RUN_STATE, "run")
        if (path / STRATEGY_STATE).is_file():
            state["strategy"] = _decode(path / STRATEGY_STATE, "strategy")
    except (OSError, state_codec.StateDecodeError) as exc:
        return _one_line(exc)
    wrong = [k for k, t in RUN_STATE_KEYS.items() if not isinstance(state.get(k), t)]
    if wrong:
        return f"{RUN_STATE} lacks a run's {', '.join(wrong)}"
    for f in sorted((path / "policies").rglob("*")):
        try:
            if f.suffix == ".pt":
                torch.load(f, map_location="cpu", weights_only=True, mmap=True)
            elif f.name == ".metadata":  # a sharded learner's (policies.dcp_reader)
                from mutualrl.policies.dcp_reader import read_metadata

                read_metadata(f)
        except Exception as exc:  # noqa: BLE001 - whatever torch raises, the file is unusable
            return f"{f.relative_to(path)} does not load ({_one_line(exc)})"
    return Checkpoint(path, int(path.name[len(PREFIX) :]), state)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def restore(run: Run, ckpt: Checkpoint) -> int:
    """Load the checkpoint into a freshly built run; returns the next step to train."""
    names = run.live()
    missing = [n for n in names if not (ckpt.path / "policies" / n).is_dir()]
    if missing:
        raise ConfigError(f"--resume: checkpoint {ckpt.path} has no state for policies {missing}")
    loaded = call_each(
        run.executor, {n: RestoreCheckpoint(str(ckpt.path / "policies" / n)) for n in names}
    )
    if set(loaded) != set(names):
        raise RuntimeError(f"--resume: restoring {sorted(set(names) - set(loaded))} failed")
    state = dict(ckpt.state)
    try:
        run.load_state_dict(state)
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as exc:
        raise ConfigError(
            f"--resume: {ckpt.path / RUN_STATE} does not hold the state of this "
            f"run as this version writes it ({type(exc).__name__}: "
            f"{_one_line(exc)}); start afresh (--overwrite)"
        ) from exc
    return int(state["step"])


# ---- small file helpers -------------------------------------------------------------------------
def _decode(path: Path, what: str) -> dict[str, Any]:
    """A checkpoint's state file as data. A record of an experience kind this process has not
    registered (one a script defined) is an error that says so, not a damaged checkpoint."""
    try:
        state = state_codec.decode(path.read_bytes(), what, str(path))
    except state_codec.UnknownKindInState as exc:
        raise ConfigError(
            f"--resume: {exc}; expected every experience kind the run used to be "
            "registered, as when it wrote the checkpoint: define them in an "
            "installed module (an entry point), not in a script"
        ) from exc
    if not isinstance(state, dict):
        raise state_codec.StateDecodeError(
            f"{path}: holds a {type(state).__name__}, expected a table of state"
        )
    return state


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    if sys.platform.startswith("win"):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
