"""Writes that are whole or absent, and OS errors that say what happened and what was kept.

Every append-only file of a run (metrics, held-out results, experience-log frames) gets whole
records: ``append_whole`` writes a record's bytes and, when the write fails part way (a full
disk), cuts the file back to where the record began, so no torn line or frame is ever left.
Folders that must be complete (a checkpoint, a saved policy) are written under a temporary
name and renamed into place (``atomic_folder``). A failure becomes one ``StorageError`` naming
the file, the OS's reason ("no space left on device") and what is kept. What is removed is
removed through ``remove_tree``, which refuses anything not strictly inside the folder it must
be in: a path built from a name (``RUN_DIR/policies/..``) never removes the run folder or
anything outside it.

Scratch folders in ``TMPDIR`` (what a vLLM engine reloads from: a whole copy of a model) are
``ScratchFolder``s: removed when closed, and, when their process was killed before it could
close them, by the next one made beside them (``sweep_scratch``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator
from pathlib import Path

# Below this many free bytes a failed write is put down to a full disk even when the library
# that wrote reports something else (torch's zip writer says "unexpected pos").
LOW_SPACE_BYTES = 1 << 20


class StorageError(OSError):
    """A write that failed; the message names the file, the reason and what was kept."""


def storage_error(
    exc: BaseException, path: str | Path, kept: str, full: bool = False
) -> StorageError:
    """``exc`` (from writing ``path``) as a ``StorageError`` saying why and what is ``kept``;
    ``full``: the caller found the disk full when the write failed."""
    code = getattr(exc, "errno", None)
    if code is None and (full or disk_full(exc, path)):
        code = errno.ENOSPC
    reason = os.strerror(code).lower() if code else f"{type(exc).__name__}: {exc}"
    err = StorageError(code or errno.EIO, f"{path}: {reason}; {kept}")
    err.filename = str(path)
    return err


def disk_full(exc: BaseException, path: str | Path) -> bool:
    """Whether ``exc``, raised while writing ``path``, comes of a full disk: ENOSPC, or the disk
    nearly full now (ask before removing what the failed write left). A worker's failure arrives
    as its message, so ENOSPC is also recognised there."""
    return (
        getattr(exc, "errno", None) == errno.ENOSPC
        or _low_space(Path(path))
        or "No space left on device" in str(exc)
    )


def _low_space(path: Path) -> bool:
    for p in (path, *path.parents):
        if p.exists():
            try:
                return shutil.disk_usage(p).free < LOW_SPACE_BYTES
            except OSError:
                return False
    return False


def append_whole(fd: int, data: bytes, path: str | Path, kept: str = "") -> None:
    """Append ``data`` to the ``O_APPEND`` descriptor ``fd`` as a whole: on failure the file is
    cut back to its length before, and a ``StorageError`` is raised."""
    start = os.lseek(fd, 0, os.SEEK_END)
    view = memoryview(data)
    try:
        while view:  # os.write may write less than asked; finish the same record
            view = view[os.write(fd, view) :]
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, start)
        raise storage_error(
            exc, path, kept or f"the record was not written; the {start} bytes before it are kept"
        ) from exc


class OutsideFolder(StorageError):
    """A removal refused: the path is not strictly inside the folder it was meant to be in."""


def strictly_inside(path: str | Path, folder: str | Path) -> bool:
    """Whether ``path`` names an entry strictly inside ``folder`` (not ``folder`` itself, not
    outside it), its parents' symbolic links followed as the OS would. ``path`` itself is not
    followed: a link inside ``folder`` is inside, and removing it removes the link only."""
    path = Path(path)
    if path.name in ("", ".", ".."):  # "x/.." names x's parent: resolve it whole
        real = Path(os.path.realpath(path))
    else:
        real = Path(os.path.realpath(path.parent)) / path.name
    return Path(os.path.realpath(folder)) in real.parents


def remove_tree(path: str | Path, within: str | Path) -> None:
    """Remove ``path`` (a folder, a file or a link) only if it lies strictly inside ``within``:
    a path built from a name (a policy's, a run's) can never remove ``within`` or anything
    outside it. A refusal is an ``OutsideFolder`` error naming both."""
    path = Path(path)
    if not strictly_inside(path, within):
        err = OutsideFolder(
            errno.EINVAL,
            f"{path}: refused to remove it, it is not strictly "
            f"inside {within} (only a run's own files are removed)",
        )
        err.filename = str(path)
        raise err
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


@contextlib.contextmanager
def atomic_folder(final: str | Path, what: str, within: str | Path | None = None) -> Iterator[Path]:
    """A temporary folder beside ``final`` to write into; renamed to ``final`` (replacing it)
    when the block succeeds, removed when it fails, so ``final`` is complete or absent.
    ``final`` must lie strictly inside ``within`` (default: its parent), checked before
    anything is written: what it replaces is removed."""
    final = Path(final)
    within = Path(within) if within is not None else final.parent
    if not strictly_inside(final, within):
        err = OutsideFolder(
            errno.EINVAL,
            f"{final}: {what} was not written: the path is not strictly inside {within}",
        )
        err.filename = str(final)
        raise err
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        yield tmp
        remove_tree(final, within)
        os.rename(tmp, final)
    except BaseException as exc:
        full = (
            isinstance(exc, Exception) and not isinstance(exc, StorageError) and disk_full(exc, tmp)
        )
        shutil.rmtree(tmp, ignore_errors=True)
        if not full:
            raise
        raise storage_error(
            exc, final, f"{what} was not written (nothing of it is kept)", full=True
        ) from exc


# The lock file of a ScratchFolder: held (flock) by the owning process for as long as it lives.
SCRATCH_LOCK = ".mutualrl-scratch.lock"


class ScratchFolder:
    """A temporary folder ``<parent>/<prefix>XXXXXXXX``, its process's for as long as the process
    lives. ``cleanup()`` (or the object's collection, or the interpreter's exit) removes it. A
    process killed first (SIGKILL, the OOM killer) cannot, so the folder holds a lock file its
    owner keeps an ``flock`` on; the kernel drops the lock with the process, however it ends, and
    the next ``ScratchFolder`` made in the same parent removes every folder whose lock is free
    (``sweep_scratch``). A folder still in use is never touched: its lock is held."""

    def __init__(self, prefix: str, parent: str | Path | None = None) -> None:
        parent = Path(parent or tempfile.gettempdir())
        self.swept = sweep_scratch(parent)
        self.path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
        # Locked under another name, then renamed: a sweep never sees the lock unheld.
        fd = os.open(self.path / f"{SCRATCH_LOCK}.new", os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(self.path / f"{SCRATCH_LOCK}.new", self.path / SCRATCH_LOCK)
        self._finalizer = weakref.finalize(self, _remove_scratch, self.path, fd)

    def cleanup(self) -> None:
        """Remove the folder and give up its lock (again: nothing)."""
        self._finalizer()


def _remove_scratch(path: Path, fd: int) -> None:
    try:
        _remove_folder(path)
    finally:
        os.close(fd)


# A scratch folder being removed is first renamed to this prefix plus its name.
REMOVING = ".mutualrl-removing-"


def _remove_folder(path: Path) -> None:
    """Remove a scratch folder so that a process killed at any point of it leaves what the next
    sweep removes. ``shutil.rmtree`` would not: it may unlink the lock file first, and the rest,
    with no lock file, would never be recognised. So the folder is renamed to ``REMOVING`` plus
    its name (atomic, lock file inside), emptied with its lock file last, then removed; a
    ``REMOVING`` folder left without its lock file is empty, and any sweep removes it."""
    if not path.name.startswith(REMOVING):
        gone = path.with_name(REMOVING + path.name)
        try:
            os.rename(path, gone)
            path = gone
        except FileNotFoundError:  # removed already (by a sweep)
            return
        except OSError:  # not renamed: removed where it is, its lock file still last
            pass
    try:
        entries = list(os.scandir(path))
    except OSError:
        return
    for entry in sorted(entries, key=lambda e: e.name == SCRATCH_LOCK):  # the lock file last
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
    with contextlib.suppress(OSError):
        os.rmdir(path)


def sweep_scratch(parent: str | Path) -> list[Path]:
    """Remove the ``ScratchFolder``s in ``parent`` whose owner is gone (their lock is free); the
    folders removed."""
    removed = []
    for lock in Path(parent).glob(f"*/{SCRATCH_LOCK}"):
        try:
            fd = os.open(lock, os.O_RDWR)
        except OSError:  # removed meanwhile, or not ours to open
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its owner lives
            os.close(fd)
            continue
        try:
            _remove_folder(lock.parent)
            removed.append(lock.parent)
        finally:
            os.close(fd)
    for left in Path(parent).glob(f"{REMOVING}*"):  # emptied by an owner killed at its end
        with contextlib.suppress(OSError):
            os.rmdir(left)
    return removed
