"""Rank 0's whole copy of a sharded learner's weights, for generation.

After every change of the weights (an update, a supervised step, a load) the copy is refreshed
parameter by parameter: each sharded parameter is gathered (``DTensor.full_tensor()``, a
collective every rank joins) and copied into rank 0's copy, then dropped, so no rank ever holds
a second whole model; ranks other than 0 discard what they gathered at once. A probe then
checks the copy against the sharded model itself: the log-probs of a fixed token sequence under
both (every rank computes the sharded one) must agree within ``generation.sync_tolerance``.

``MirrorSource`` is what a generation backend reads of a learner (``policies.generation``): the
copy as its model, the learner's version and device, and log-prob functions in the policy's
precision.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, cast

import torch

from mutualrl.policies.batch import collate
from mutualrl.policies.generation import sync_tolerance
from mutualrl.policies.generation.vllm import WeightSyncError
from mutualrl.policies.sharded.fsdp import settle

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

PROBE_TOKENS = 32  # a fixed sequence: token ids 1..32 (modulo the vocabulary)


def _whole(p: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The whole of a sharded parameter (a collective), on ``device`` (offloaded shards move)."""
    return cast("DTensor", p.to(device)).full_tensor() if hasattr(p, "full_tensor") else p


class WeightMirror:
    """Keeps ``full`` (rank 0's whole model; None on other ranks) equal to ``learner.model``."""

    def __init__(self, learner, full: torch.nn.Module | None) -> None:
        self.learner, self.full = learner, full
        self.params = dict(full.named_parameters()) if full is not None else {}

    @torch.no_grad()
    def refresh(self) -> None:
        """Gather every parameter in turn into rank 0's copy (all ranks call this together)."""
        for name, p in self.learner.model.named_parameters():
            whole = _whole(p, self.learner.device)
            if name in self.params:
                self.params[name].copy_(whole)
            del whole

    @torch.no_grad()
    def probe_gap(self, vocab_size: int) -> float | None:
        """Largest |log-prob difference| between the sharded model and the copy on the probe
        sequence (all ranks call this together); None on ranks without the copy."""
        ids = tuple(1 + i % (vocab_size - 1) for i in range(PROBE_TOKENS))
        c = collate([ids[: PROBE_TOKENS // 2]], [ids[PROBE_TOKENS // 2 :]], 0)
        model = self.learner.model
        was_training = model.training
        model.eval()
        sharded = self.learner.logprobs.plain_logprobs(model, c).float()
        settle(model)
        model.train(was_training)
        if self.full is None:
            return None
        whole = MirrorSource(self.learner, self.full).logprobs.plain_logprobs(self.full, c).float()
        return float((sharded - whole).abs().max())

    def sync(self, vocab_size: int) -> dict[str, float]:
        """Refresh, then probe (when ``generation.sync_check``); raise if the copy is off."""
        self.refresh()
        gen = self.learner.cfg.generation
        if not gen.sync_check:
            return {}
        gap = self.probe_gap(vocab_size)
        if gap is None:
            return {}
        tol = sync_tolerance(gen, self.learner.cfg.dtype != "bf16")
        if gap > tol:
            raise WeightSyncError(
                f"policy {self.learner.name!r}: rank 0's copy of the sharded "
                f"weights differs from them by {gap:.3g} in log-prob on the probe "
                f"(generation.sync_tolerance {tol:g})"
            )
        return {"sync/shard_probe_gap": gap}


class MirrorSource:
    """The learner as a generation backend sees it, over rank 0's copy of its weights."""

    def __init__(self, learner, full: torch.nn.Module) -> None:
        self.learner, self.model, self.device = learner, full, learner.device
        # The sharded model casts itself (no autocast); the copy is a plain module: a bf16
        # policy's copy (bf16 already) computes under bf16 autocast, an fp32 one in fp32.
        self.logprobs = replace(learner.logprobs, bf16=learner.cfg.dtype == "bf16")

    @property
    def version(self) -> int:
        return self.learner.version
