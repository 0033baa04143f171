"""Peak accelerator memory of a policy's process, reported with each update's stats.

``torch.cuda``'s own counters: the most memory tensors held (``max_memory_allocated``) and the
most the caching allocator reserved from the card (``max_memory_reserved``, what ``nvidia-smi``
shows, less the CUDA context), since the previous report, and how often the allocator ran out
and had to free its cache and retry (``num_alloc_retries``, cumulative): a policy near its
card's limit shows retries before it fails. The counters are the process's: where one process
holds several policies (``allocation.executor = "local"``), each reports the process's peak.
Off CUDA there is nothing to report.

``Capped``: a worker factory whose process caps the caching allocator at the plan's share of a
GPU it shares with other processes (``allocation.memory.cap_shared_gpus``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

_cap_bytes: int | None = None  # this process's cap (cap_process_memory), reported with its peaks

GIB = 2**30


def peak_memory_stats(device: torch.device | str) -> dict[str, float]:
    """``cuda/peak_allocated_gib``, ``cuda/peak_reserved_gib`` since the last call in this process,
    and ``cuda/alloc_retries`` so far, and ``cuda/memory_cap_gib`` where this process is capped
    (``Capped``); the peaks start again from now. {} off CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return {}
    stats = {
        "cuda/peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB,
        "cuda/peak_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB,
        "cuda/alloc_retries": float(torch.cuda.memory_stats(device).get("num_alloc_retries", 0)),
    }
    if _cap_bytes is not None:
        stats["cuda/memory_cap_gib"] = _cap_bytes / GIB
    torch.cuda.reset_peak_memory_stats(device)
    return stats


def cap_process_memory(cap_bytes: int, device: int = 0) -> float | None:
    """Cap this process's caching allocator on ``device`` at ``cap_bytes``
    (``torch.cuda.set_per_process_memory_fraction``): past it, an allocation first frees the
    process's cache and retries, then raises ``torch.OutOfMemoryError``. Returns the fraction of
    the card set, or None without CUDA. The CUDA context is not counted in the cap."""
    global _cap_bytes
    if not torch.cuda.is_available():
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = min(1.0, cap_bytes / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    _cap_bytes = min(cap_bytes, total)  # the updates report it (peak_memory_stats)
    return fraction


@dataclass(frozen=True)
class Capped:
    """A worker factory (picklable) that caps its process's GPU memory at ``cap_bytes`` before it
    builds: ``build`` is a policy's factory, or a rank group's per-rank ``build``. Only for a
    process of its own (the process and Ray executors), one visible GPU: ``cuda:0``."""

    cap_bytes: int
    build: Callable[..., Any]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        cap_process_memory(self.cap_bytes)
        return self.build(*args, **kwargs)
