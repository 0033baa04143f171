"""Ending workers' processes, and sweeping what the killed ones leave behind.

The executor kinds that host workers in processes of their own end them and clean up after them
alike. The process executor's worker leads a process group of its own, which ``end_group`` ends.
A worker killed before it could close (hung, or slower to close than its executor waits: an
engine's shutdown on a loaded machine) leaves its scratch folders (``storage.ScratchFolder``, a
vLLM engine's copy of its model), which would otherwise wait for the next engine made in that
TMPDIR: ``sweep_left_scratch`` removes them once the killed processes have ended, on this machine
(the process executor) or as a task on each node that held killed actors (the Ray executor).
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from collections.abc import Sequence

from mutualrl.storage import sweep_scratch


def end_group(pgid: int, grace_s: float) -> None:
    """End process group ``pgid``: SIGTERM, then SIGKILL to whatever is left after ``grace_s``."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):  # no such group (left): nothing to end
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not _group_runs(pgid):
                return
            time.sleep(0.05)


def _group_runs(pgid: int) -> bool:
    """Whether a member of group ``pgid`` still runs. A zombie does not, though it stays a
    member until reaped, and an init that reaps nothing (some containers') keeps it for good.
    From ``/proc`` where there is one; else any member counts."""
    try:
        pids = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                state, _, group = f.read().rsplit(b")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue  # gone meanwhile
        if int(group) == pgid and state != b"Z":
            return True
    return False


def sweep_left_scratch(pids: Sequence[int] = (), wait_s: float = 0.0) -> list[str]:
    """Once the killed processes ``pids`` are gone (at most ``wait_s``), remove the scratch
    folders in this machine's TMPDIR whose owner is gone (their lock is free), whoever's they
    are; the folders removed."""
    deadline = time.monotonic() + wait_s
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [str(p) for p in sweep_scratch(tempfile.gettempdir())]


def _alive(pid: int) -> bool:
    """Whether a process may still hold its files. A killed process's first thread turns zombie
    while its other threads (an actor has many) still exit, and its files, and so its locks, are
    closed only with the last of them: alive while any thread is not a zombie."""
    try:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        return any(state not in ("Z", "X") for state in states)
    except FileNotFoundError:  # gone (reaped), or a thread gone while listing: look again
        return os.path.exists(f"/proc/{pid}") and _alive_by_signal(pid)
    except OSError:  # no /proc: whether it can be signalled
        return _alive_by_signal(pid)


def _alive_by_signal(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
