"""Peak accelerator memory of a policy's process, reported with each update's stats.

``torch.cuda``'s own counters: the most memory tensors held (``max_memory_allocated``) and the
most the caching allocator reserved from the card (``max_memory_reserved``, what ``nvidia-smi``
shows, less the CUDA context), since the previous report, and how often the allocator ran out
and had to free its cache and retry (``num_alloc_retries``, cumulative): a policy near its
card's limit shows retries before it fails. The counters are the process's: where one process
holds several policies (``allocation.executor = "local"``), each reports the process's peak.
Off CUDA there is nothing to report.
"""

from __future__ import annotations

import torch

GIB = 2 ** 30


def peak_memory_stats(device: torch.device | str) -> dict[str, float]:
    """``cuda/peak_allocated_gib``, ``cuda/peak_reserved_gib`` since the last call in this process,
    and ``cuda/alloc_retries`` so far; the peaks start again from now. {} off CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return {}
    stats = {"cuda/peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB,
             "cuda/peak_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB,
             "cuda/alloc_retries": float(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))}
    torch.cuda.reset_peak_memory_stats(device)
    return stats
