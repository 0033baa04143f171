"""A real tmpfs of a given size for the disk-full tests (root only; skipped where it cannot be
mounted): the full disk itself, not a fake of it."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def mounted_tmpfs(mnt: Path, size: str) -> Iterator[Callable[[str], None]]:
    """Mount a tmpfs of ``size`` (e.g. "110m") at the new folder ``mnt``, unmounted at the end;
    yields a function that resizes it in place."""
    mnt.mkdir()
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")

    def resize(new_size: str) -> None:
        subprocess.run(["mount", "-o", f"remount,size={new_size}", str(mnt)], check=True)

    try:
        yield resize
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
