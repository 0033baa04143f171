"""A policy's compute precision: what ``dtype = "auto"`` chooses, and a note before training when
a chosen precision is slow on the machine it runs on.

``dtype = "bf16"`` runs forward and backward under bf16 autocast (``policies.logprobs``) over fp32
master weights and AdamW moments, log-softmax in fp32. Where the device multiplies bf16 matrices
in hardware (CUDA with bf16; a CPU with AVX512-BF16 or AMX tiles) that is the fast path: on a
2-core AVX512-BF16 CPU, SmolLM2-135M's forward and backward ran 1.8x faster than in fp32. Small
matrices gain nothing: at width 64-128 the casts cost more than the products save (0.8x on the
same CPU), so ``"auto"`` keeps such models (the embedded default's, the tests') in fp32.

A CPU without bf16 matrix instructions emulates bf16 GEMMs, an order of magnitude slower than fp32
(on a 2-core AVX2 VM a hidden-64 policy's update took 4.6 s against 0.39 s on a 32k vocabulary):
``"auto"`` never chooses it there, and an explicit ``"bf16"`` is a warning, not an error.
"""

from __future__ import annotations

import warnings
from typing import Literal

import msgspec
import torch

from mutualrl.config import PolicyConfig, RunConfig

# The narrowest model ``"auto"`` computes in bf16: measured 0.8x of fp32 at width 128 and 1.6-2.1x
# at 256-576 (a Llama decoder's forward and backward, 2-core AVX512-BF16 CPU).
BF16_MIN_WIDTH = 256


class SlowPrecisionWarning(UserWarning):
    """A policy's ``dtype`` is emulated on its device and much slower than ``fp32`` there."""


def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (AVX512-BF16 or AMX tiles)."""
    probes = [
        getattr(torch.cpu, name, None)
        for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    ]
    return any(p() for p in probes if p is not None) or all(p is None for p in probes)


def native_bf16(device: str) -> bool:
    """Whether ``device`` computes bf16 matrix products in hardware."""
    d = torch.device(device)
    if d.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    return d.type == "cpu" and cpu_has_bf16_matmul()


def model_width(p: PolicyConfig) -> int | None:
    """The policy's hidden size: its checkpoint's (config.json, read by transformers' config
    class), else the random-init model's; None when the checkpoint is not on this machine."""
    if not p.checkpoint:
        return p.hidden_size
    from mutualrl.policies.checkpoints import read_checkpoint_config, text_config

    try:
        raw = read_checkpoint_config(p)
        return None if raw is None else int(text_config(raw).hidden_size)
    except (AttributeError, TypeError, ValueError, OSError):
        return None  # the checkpoint check names what is wrong with the folder


def compute_dtype(p: PolicyConfig, device: str) -> Literal["fp32", "bf16"]:
    """The precision ``p`` computes in on ``device``: its ``dtype``, or for ``"auto"`` bf16 where
    the device computes it natively and the model is wide enough to gain, fp32 elsewhere."""
    if p.dtype != "auto":
        return p.dtype
    width = model_width(p)
    wide = width is None or width >= BF16_MIN_WIDTH  # a model not on this machine: a real one
    return "bf16" if wide and native_bf16(device) else "fp32"


def resolve_precision(cfg: RunConfig) -> RunConfig:
    """``cfg`` with every ``dtype = "auto"`` replaced by the precision it chooses here, so the
    run folder's ``config.json`` (and a resume of it) says which one ran."""
    if all(p.dtype != "auto" for p in cfg.policies):
        return cfg
    policies = [
        msgspec.structs.replace(p, dtype=compute_dtype(p, cfg.device)) for p in cfg.policies
    ]
    return msgspec.structs.replace(cfg, policies=policies)


def check_precision(policies: list[PolicyConfig], device: str) -> None:
    """Warn (``SlowPrecisionWarning``) when bf16 policies will run on a CPU that emulates bf16."""
    slow = [p.name for p in policies if p.dtype == "bf16"]
    if slow and torch.device(device).type == "cpu" and not cpu_has_bf16_matmul():
        warnings.warn(
            f'policies {slow}: dtype = "bf16" on device "cpu", which has no bf16 matrix '
            f"instructions (AVX512-BF16 or AMX): the update runs about 10-25x slower than in "
            f'fp32 here; set dtype = "fp32" (or "auto") for CPU runs '
            f'(e.g. --set policies.0.dtype="fp32")',
            SlowPrecisionWarning,
            stacklevel=2,
        )


def precision_notes(cfg: RunConfig) -> tuple[str, ...]:
    """The plan's line on what each policy computes in (``cfg`` resolved)."""
    chosen = ", ".join(f"{p.name} {compute_dtype(p, cfg.device)}" for p in cfg.policies)
    return (f"compute precision (policies.*.dtype): {chosen}",)
