"""Where a number came from: the commit, the machine, and a plain timing loop.

Benchmarks and compare reports record these so a figure can be traced and compared later.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path


def git_commit(where: Path | None = None) -> str:
    """The commit the code came from (``+dirty`` if tracked files differ); "unknown" outside git."""
    where = where or Path(__file__).resolve().parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=where,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = (
            subprocess.run(
                ["git", "diff", "--quiet", "HEAD", "--"], cwd=where, capture_output=True, timeout=10
            ).returncode
            != 0
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "") if head else "unknown"


def source_digest() -> str:
    """sha256 (16 hex) of every Python source file of the installed ``mutualrl`` package: any code
    change, committed or not, versioned or not, gives another digest (caches key on it)."""
    import hashlib

    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


# The matrix instructions that decide what a CPU computes fastest (bf16 natively or not): hosts
# of one cloud machine type differ in them, and timings taken on two of them do not compare.
MATRIX_FLAGS = ("avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def cpu_model() -> dict[str, object]:
    """The CPU's model name and which of ``MATRIX_FLAGS`` it has, from ``/proc/cpuinfo``
    (Linux); empty elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields = dict(
        (k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in text.splitlines())
    )
    flags = set(fields.get("flags", "").split())
    return {
        "cpu_model": fields.get("model name", ""),
        "cpu_matrix_flags": [f for f in MATRIX_FLAGS if f in flags],
    }


def machine_info(**versions: str | None) -> dict[str, object]:
    """Platform, processor, cores, load and Python, plus the library ``versions`` a benchmark names.

    ``loadavg`` (1, 5, 15 min) says how busy the machine was: on a shared host, absolute timings
    are only comparable between runs of similar load, ratios measured side by side much more so.
    """
    load = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        **cpu_model(),
        "cpu_count": os.cpu_count(),
        "loadavg": load,
        "python": sys.version.split()[0],
        **versions,
    }


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while timing, as ``timeit`` does (after one full
    collection): a collection's length depends on every object the process holds, not on the
    call it interrupts, and a call that builds many lists (TRL's walk) would be charged for
    whichever collection falls in it. Reference counting still frees everything as usual."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def time_calls(fn: Callable[[], object], repeats: int) -> list[float]:
    """Wall seconds of ``repeats`` calls of ``fn`` after one warm-up call (collector paused)."""
    with collector_paused():
        fn()
        out = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return out


def time_alternating(fns: Sequence[Callable[[], object]], repeats: int) -> list[list[float]]:
    """Wall seconds of ``repeats`` calls of each contender, in turn after one warm-up call of
    each, so that drift in the machine's speed falls on all alike (collector paused). Each round
    starts one contender later (A B C, B C A, C A B, ...): what runs just before a call changes
    how long it takes (a Rust call right after another, a numpy pass after a Python loop), and
    in a fixed order each contender would always follow the same one."""
    return time_turns(fns, repeats)[0]


def time_turns(
    fns: Sequence[Callable[[], object]], repeats: int, min_turn_s: float = 0.0
) -> tuple[list[list[float]], list[int]]:
    """``time_alternating`` where each contender's turn is as many calls as fill ``min_turn_s``
    (counted from a second warm-up call): (seconds per call of each turn, per contender; calls per
    turn). With contenders of very unequal length, a one-call turn measures the short one
    cold, right after the long one, and on a shared VM that first call after other work can
    take twice its steady time (``benchmarks/cold_call.py``); turns of equal length compare both
    at steady state and still alternate against drift."""
    calls = []
    out: list[list[float]] = [[] for _ in fns]
    with collector_paused():
        for fn in fns:
            fn()
            if min_turn_s > 0:
                start = time.perf_counter()
                fn()
                took = time.perf_counter() - start
                calls.append(max(1, math.ceil(min_turn_s / max(took, 1e-9))))
            else:
                calls.append(1)
        n = len(fns)
        for r in range(repeats):
            for i in (*range(r % n, n), *range(r % n)):
                fn, k = fns[i], calls[i]
                start = time.perf_counter()
                for _ in range(k):
                    fn()
                out[i].append((time.perf_counter() - start) / k)
    return out, calls
