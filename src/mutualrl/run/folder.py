"""A run folder has one writer: an OS lock held for the run's whole life, and no silent reuse.

``claim(folder)`` takes an exclusive ``flock`` on the folder itself (an open directory
descriptor, so taking it writes nothing): a second ``train``/``--resume`` on the same folder
fails at once, naming the process that holds it (its pid and command line, which the holder
writes to ``RUN_DIR/.lock`` once it has the lock). The kernel drops the lock when its holder
exits, however it exits, so a lock left by a dead process never blocks a resume; the stale
``.lock`` file is only read to name a live holder.

A fresh run into a folder that already holds a run is refused before anything is written, naming
``--resume`` and ``--overwrite``; ``--overwrite`` deletes that run's files first (and only them:
the names a run writes, inside the folder, and only in a folder a run has marked as its own with
its lock note or its config.json, so a user's ``config.json`` or ``checkpoints/`` in a folder no
run wrote is never deleted). A folder this process cannot write (a read-only file system, a parent
that is a file) is one error naming it, before anything is written.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
from pathlib import Path

from mutualrl.config import ConfigError
from mutualrl.storage import remove_tree

LOCK_FILE = ".lock"
# What a run writes into its folder; any of them present means the folder holds a run.
RUN_FILES = (
    "config.json",
    "plan.json",
    "metrics.jsonl",
    "heldout.jsonl",
    "summary.json",
    "metrics.discarded.jsonl",
    "heldout.discarded.jsonl",
    "failures.jsonl",
)
RUN_DIRS = ("experience", "checkpoints", "policies", "tensorboard", "wandb")


class RunFolderBusy(ConfigError):
    """Another live process holds the run folder."""


def holds_a_run(folder: Path) -> list[str]:
    """The run files and folders ``folder`` holds (empty: none, it may take a fresh run)."""
    return [n for n in (*RUN_FILES, *RUN_DIRS) if (folder / n).exists()]


class RunFolder:
    """The exclusive claim on one run folder; ``release`` (or process exit) gives it up."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __enter__(self) -> RunFolder:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def claim(
    folder: str | Path, *, resume: bool = False, overwrite: bool = False, what: str = "run"
) -> RunFolder:
    """Lock ``folder`` for this process (creating it if needed) and check it may be written.

    ``resume``: the folder must hold a run (checked by the caller's checkpoint search).
    Otherwise a folder holding a run is refused unless ``overwrite``, which deletes its run files.
    ``what`` names the folder's kind in messages ("run", "compare")."""
    path = Path(folder)
    if resume and not path.is_dir():
        raise ConfigError(f"--resume: {path} is not a run folder (no such directory)")
    if path.exists() and not path.is_dir():
        raise ConfigError(
            f"output_dir (--output-dir): {path} is an existing file; expected a "
            f"directory to write the {what} into (or a path that does not exist yet)"
        )
    made = [p for p in (path, *path.parents) if not p.exists()]
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        _unmake(made)
        raise _unwritable(path, exc, what) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunFolderBusy(
            f"{path}: another mutualrl process is writing this {what} folder "
            f"({_holder(path)}); wait for it to end or stop it. A folder has one "
            "writer at a time"
        ) from None
    try:
        # Refusals first (nothing written), then the first write (a folder this process cannot
        # write fails there, nothing deleted yet), then --overwrite's deletions.
        replaced = _check_fresh(path, overwrite) if not resume and what == "run" else []
        try:
            (path / LOCK_FILE).write_text(
                f"pid {os.getpid()}: {' '.join(sys.argv)}\n", errors="backslashreplace"
            )  # argv: any bytes
        except OSError as exc:
            _unmake(made)
            raise _unwritable(path, exc, what) from None
        for name in replaced:
            remove_tree(path / name, within=path)  # a link is removed, not what it points to
    except BaseException:
        os.close(fd)
        raise
    return RunFolder(path, fd)


def _unwritable(path: Path, exc: OSError, what: str) -> ConfigError:
    reason = os.strerror(exc.errno).lower() if exc.errno else str(exc)
    where = f" ({exc.filename})" if exc.filename and Path(exc.filename) != path else ""
    return ConfigError(
        f"output_dir (--output-dir): {path}: cannot write the {what} folder there: "
        f"{reason}{where}; expected a folder this process may create and write "
        "(nothing was written)"
    )


def _unmake(made: list[Path]) -> None:
    """Remove the folders ``claim`` created before it failed (deepest first; empty only)."""
    for p in made:
        with contextlib.suppress(OSError):
            p.rmdir()


def _marked_as_a_run(path: Path) -> bool:
    """Whether a run wrote ``path``: its lock note, or a run's config.json (runs made before the
    note existed). Only such a folder's run files may be deleted by --overwrite."""
    with contextlib.suppress(OSError, UnicodeDecodeError):
        if (path / LOCK_FILE).read_text().startswith("pid "):
            return True
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and {"policies", "output_dir", "strategy"} <= config.keys()


def _holder(path: Path) -> str:
    try:
        return (path / LOCK_FILE).read_text().strip() or "pid unknown"
    except OSError:
        return "pid unknown"


def _check_fresh(path: Path, overwrite: bool) -> list[str]:
    """The run files --overwrite is to delete (none: the folder holds no run); a folder holding
    a run without --overwrite, or run-named files no run wrote, is refused."""
    found = holds_a_run(path)
    if not found:
        return []
    if not _marked_as_a_run(path):
        raise ConfigError(
            f"output_dir (--output-dir): {path} holds {', '.join(found)}, named as a run's files, "
            "but no run wrote this folder (no run's .lock note or config.json); --overwrite "
            "deletes only a run's files, so nothing here is deleted: choose another --output-dir"
        )
    if not overwrite:
        raise ConfigError(
            f"output_dir (--output-dir): {path} already holds a run ({', '.join(found)}); continue "
            f"it with `mutualrl train --resume {path}`, start it afresh with --overwrite (deletes "
            "those files), or choose another --output-dir"
        )
    return found
