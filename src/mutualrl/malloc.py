"""The process's memory allocator, set up to reuse large buffers (glibc on Linux).

With glibc's defaults, every buffer above the mmap threshold (128 KiB, rising to at most 32 MiB)
is a fresh ``mmap`` and is unmapped again when freed, so the (B, T, V) logits, log-softmax and
gradient buffers of every update (131 MB each on the default workload) are page-faulted anew on
every step, about half of the update's time on CPU. Worse in a worker thread: glibc gives each
thread its own arena, and a thread arena cannot hold a block over 64 MB, so there every such
buffer is mapped and unmapped whatever the threshold (the same update: 356 ms in an executor
thread, 187 ms on the main thread).

``reuse_large_buffers`` (called once at start-up by the CLI's training commands, by each worker
process and by the training benchmarks) switches that off with ``mallopt``: one arena for every
thread, no mmap for large blocks (they come from the heap, and freed ones are reused), and no
trimming of the heap's top. The process keeps its peak heap until it exits, which is what a
training process does anyway.

The one arena has a cost: threads that allocate many small blocks at once wait for its lock. The
Rust tokenizers' ``encode_batch`` on two threads took 33 ms instead of 12 ms for the THL
benchmark's corpus (WordPiece), slower than one thread (22 ms). Commands that do not train
(``mutualrl bench retokenize``, ``plan``, ``exchange inspect``) therefore keep glibc's defaults,
and so does a plain Python process that uses the retokenizer as a library.

Left alone when another allocator is preloaded (tcmalloc, jemalloc: ``LD_PRELOAD``), when not on
glibc, or when ``MUTUALRL_MALLOC=system`` asks for glibc's defaults.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
_state: dict[str, str] = {}


def reuse_large_buffers() -> str:
    """Apply the set-up once per process; returns what is in effect ("reuse", "system",
    "preloaded: <lib>" or "unavailable: <why>")."""
    if "mode" in _state:
        return _state["mode"]
    _state["mode"] = mode = _apply()
    return mode


def _apply() -> str:
    if os.environ.get("MUTUALRL_MALLOC", "reuse") == "system":
        return "system"
    preload = os.environ.get("LD_PRELOAD", "")
    for lib in ("tcmalloc", "jemalloc", "mimalloc"):
        if lib in preload:
            return f"preloaded: {lib}"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 (raises AttributeError off glibc)
        mallopt = libc.mallopt
    except (OSError, AttributeError) as exc:
        return f"unavailable: {exc}"
    ok = (
        (mallopt(M_ARENA_MAX, 1) == 1)
        & (mallopt(M_MMAP_MAX, 0) == 1)
        & (mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1)
    )
    return "reuse" if ok else "unavailable: mallopt refused a setting"
