"""A note before training when a policy's compute precision is slow on the machine it runs on.

``dtype = "bf16"`` runs forward and backward under bf16 autocast (``policies.logprobs``). On a GPU
that is the fast path. A CPU without bf16 matrix instructions (AVX512-BF16 or AMX) emulates bf16
GEMMs, so the same update is an order of magnitude slower than in fp32: on a 2-core AVX2 VM a
hidden-64 policy's update took 4.6 s against 0.39 s (32k vocabulary), and 54 s against 2.2 s on a
151k one, almost all of it in ``aten::mm``. Nothing is wrong with such a run, so this is a
warning, not an error: it names the policies and says what to set instead.
"""

from __future__ import annotations

import warnings

import torch

from mutualrl.config import PolicyConfig


class SlowPrecisionWarning(UserWarning):
    """A policy's ``dtype`` is emulated on its device and much slower than ``fp32`` there."""


def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (AVX512-BF16 or AMX tiles)."""
    probes = [
        getattr(torch.cpu, name, None)
        for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    ]
    return any(p() for p in probes if p is not None) or all(p is None for p in probes)


def check_precision(policies: list[PolicyConfig], device: str) -> None:
    """Warn (``SlowPrecisionWarning``) when bf16 policies will run on a CPU that emulates bf16."""
    slow = [p.name for p in policies if p.dtype == "bf16"]
    if slow and torch.device(device).type == "cpu" and not cpu_has_bf16_matmul():
        warnings.warn(
            f'policies {slow}: dtype = "bf16" on device "cpu", which has no bf16 matrix '
            f"instructions (AVX512-BF16 or AMX): the update runs about 10-25x slower than in "
            f'fp32 here; set dtype = "fp32" for CPU runs (e.g. --set policies.0.dtype="fp32")',
            SlowPrecisionWarning,
            stacklevel=2,
        )
