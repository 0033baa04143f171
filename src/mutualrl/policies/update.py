"""The update's objective: how a ``TrainBatch`` becomes the gradients of one optimizer step
within bounded memory. The learner (``policies.learner``) owns the model, optimizer, schedule,
KL reference, version and counters and applies the step; ``Objective`` holds settings only and
is given the model (and the reference) at every call.

Each ``TrainBatch`` is one optimizer step per ``num_iterations``. Its parts are computed once
(``grpo_parts``, ``sft_parts``): the collated batch, everything that depends on the whole batch
(masks, the loss normalisers of ``grpo.normalise``, reference log-probs), and its rows cut into
micro-batches (``per_device_train_batch_size`` / ``gradient_accumulation_steps``) whose
gradients accumulate into that one step (``backward``): for every ``loss_type``, with SFT terms,
importance weights and the KL term, the step equals the single pass up to float rounding.
Log-probs come from the policy's ``LogProbs`` (``policies.logprobs``: chunked LM head, autocast).

With neither option set (the default) there is one micro-batch and it runs exactly the code of
the single pass, bit for bit. A learner of several ranks runs its share of each step's
micro-batches (``policies.ranks``); the gradient is the one-rank gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch

from mutualrl.config import GRPOConfig, PolicyConfig, TrainingConfig
from mutualrl.grpo import (
    LossShare,
    SurrogateSettings,
    clipped_surrogate,
    completion_mask,
    row_scales,
    token_mean_scale,
)
from mutualrl.policies.batch import (
    Collated,
    SFTExample,
    TrainBatch,
    collate,
    collate_sequences,
    micro_batch_slices,
    take_rows,
)
from mutualrl.policies.generation.mismatch import correct_mismatch
from mutualrl.policies.logprobs import LogProbs
from mutualrl.policies.models import base_model
from mutualrl.policies.ranks import Pass, RankShare

if TYPE_CHECKING:
    from peft import PeftModel


# ---- pure helpers -----------------------------------------------------------------------------
class _Mean:
    """A token-weighted mean over micro-batches; a single part is returned as it is."""

    def __init__(self) -> None:
        self.parts: list[tuple[torch.Tensor, torch.Tensor]] = []

    def add(self, value: torch.Tensor, tokens: torch.Tensor) -> None:
        self.parts.append((value.detach(), tokens))

    def value(self) -> float:
        if len(self.parts) == 1:
            return float(self.parts[0][0])
        total = sum(t for _, t in self.parts)
        return float(sum(v.double() * t for v, t in self.parts) / max(float(total), 1.0))


def adamw_fused(optim: str) -> bool | None:
    """torch AdamW's ``fused`` argument for ``training.optim``, as transformers' Trainer passes
    it: True for "adamw_torch_fused", None (torch's choice: its loop over tensors on a CPU) for
    "adamw_torch"."""
    return True if optim == "adamw_torch_fused" else None


def make_optimizer(
    model: torch.nn.Module,
    cfg: PolicyConfig,
    grpo: GRPOConfig,
    training: TrainingConfig,
    total_steps: int | None,
):
    """AdamW and its learning-rate schedule (transformers.get_scheduler).

    ``total_steps``: optimizer steps the schedule spans (the run's steps x num_iterations);
    needed by every schedule but "constant"."""
    from transformers import get_scheduler

    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=cfg.learning_rate or grpo.learning_rate,
        weight_decay=training.weight_decay,
        fused=adamw_fused(training.optim),
    )
    if total_steps is None and training.lr_scheduler_type != "constant":
        raise ValueError(
            f"policy {cfg.name!r}: training.lr_scheduler_type = "
            f"{training.lr_scheduler_type!r} needs the run's number of optimizer steps "
            "(total_steps), which was not given"
        )
    total = max(int(total_steps or 1), 1)
    scheduler = get_scheduler(
        training.lr_scheduler_type,
        optimizer,
        num_warmup_steps=math.ceil(total * training.warmup_ratio),
        num_training_steps=total,
    )
    return optimizer, scheduler


def prepare_model(model: torch.nn.Module, training: TrainingConfig) -> None:
    """HF gradient checkpointing, non-reentrant (no inputs need requires_grad; works with LoRA)."""
    if training.gradient_checkpointing:
        base = base_model(model)
        kwargs = {"use_reentrant": False}
        # transformers 5.24 calls it activation checkpointing and deprecates the old name;
        # earlier versions (our extras allow them) have only gradient_checkpointing_enable
        if hasattr(base, "activation_checkpointing_enable"):
            base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


@dataclass
class GRPOParts:
    """What one batch's GRPO term needs, computed once per optimizer step."""

    collated: Collated
    mask: torch.Tensor  # (B, T) on the device
    old: torch.Tensor  # (B, T) behaviour log-probs, NaN where none
    ref: list[torch.Tensor | None]  # per micro-batch (B_mb, T) reference log-probs
    scales: torch.Tensor | None  # (B,) row normalisers; None: one micro-batch
    slices: list[slice]
    stats: dict[str, float] = field(
        default_factory=dict
    )  # the sampler/trainer mismatch, if corrected
    skipped_rows: int = 0  # zero-loss rows the strategy left out (normaliser)
    skipped_tokens: int = 0
    # This rank's passes (``policies.ranks``): pass k runs micro-batch passes[k][0], its reference
    # log-probs are ref[k]. Empty (none given): pass k runs micro-batch k (one rank).
    passes: list[Pass] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.passes:
            self.passes = [(k, True) for k in range(len(self.slices))]

    def micro_batch(self, k: int) -> int:
        return self.passes[k][0]


@dataclass
class SFTParts:
    collated: Collated
    mask: torch.Tensor  # (B, T) on the device
    scale: torch.Tensor | None  # 1 / all SFT tokens; None: one micro-batch
    slices: list[slice]
    passes: list[Pass] = field(default_factory=list)  # as GRPOParts.passes

    def __post_init__(self) -> None:
        if not self.passes:
            self.passes = [(k, True) for k in range(len(self.slices))]


@dataclass
class Gradients:
    """What one optimizer step's backward passes left: the gradients are in the model's
    parameters; here are the step's statistics and what every rank agrees on."""

    stats: dict[str, float]
    finite: bool  # every rank's losses were finite
    present: bool  # some pass's loss depended on the parameters


def clip_gradients(model: torch.nn.Module, max_norm: float | None) -> torch.Tensor:
    """Clip the accumulated gradients to ``max_norm`` (None: no clipping); their total norm."""
    params = [q for q in model.parameters() if q.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm or math.inf)
    if hasattr(norm, "full_tensor"):  # sharded gradients: the norm is a replicated DTensor
        norm = norm.full_tensor()
    return norm


@dataclass
class Objective:
    """The GRPO (+SFT) objective of a policy's optimizer steps: a batch's parts, each pass's
    loss, and their gradients accumulated into the model it is given. It holds settings only:
    the model, optimizer, reference and counters are the learner's."""

    grpo: GRPOConfig
    training: TrainingConfig
    logprobs: LogProbs
    # the rank's share of each step (one rank: everything, ``policies.ranks``)
    share: RankShare

    def _slices(self, rows: int) -> list[slice]:
        """Micro-batches of ``rows`` for gradient passes: a count the ranks share evenly."""
        t = self.training
        return micro_batch_slices(
            rows, t.per_device_train_batch_size, t.gradient_accumulation_steps, self.share.world
        )

    # ---- the batch's parts, once per optimizer step -------------------------------------------
    def grpo_parts(
        self,
        model: torch.nn.Module,
        reference: torch.nn.Module | None,
        batch: TrainBatch,
        inexact_sampler: bool = False,
    ) -> GRPOParts:
        """``batch``'s GRPO parts; ``reference``: the frozen KL reference (None: ``model`` with
        its LoRA adapter disabled); ``inexact_sampler``: the behaviour log-probs came from a
        sampler that is not the trainer (vLLM), so they are recomputed and the policy term is
        weighted by the importance ratio (``generation.mismatch``)."""
        g, dev = self.grpo, self.logprobs.device
        c = collate_sequences(batch.sequences, self.logprobs.pad_id)
        mismatch = (
            correct_mismatch(c, g, lambda rows: self.logprobs.batch_logprobs(model, rows))
            if inexact_sampler
            else {}
        )
        mask = completion_mask(
            c.completion_ids, c.lengths, c.seq.truncated, g.mask_truncated_completions
        ).to(dev)
        slices = self._slices(len(batch.sequences))
        one = len(slices) == 1
        passes = self.share.passes(len(slices))
        ref = [
            self._reference_logprobs(model, reference, c if one else take_rows(c, slices[i]))
            for i, _ in passes
        ]
        scales = (
            None
            if one
            else row_scales(
                mask, g.loss_type, g.max_completion_length, batch.skipped_rows, batch.skipped_tokens
            ).to(dev)
        )
        # a copy: grpo_loss fills the peer rows' missing log-probs into it
        return GRPOParts(
            c,
            mask,
            c.seq.old_logprobs.to(dev, copy=True),
            ref,
            scales,
            slices,
            mismatch,
            batch.skipped_rows,
            batch.skipped_tokens,
            passes,
        )

    def _reference_logprobs(
        self, model: torch.nn.Module, reference: torch.nn.Module | None, c: Collated
    ) -> torch.Tensor | None:
        if self.grpo.beta == 0:
            return None
        if reference is not None:
            return self.logprobs.plain_logprobs(reference, c)
        with cast("PeftModel", model).disable_adapter():  # the policy's LoRA (peft) model
            return self.logprobs.plain_logprobs(model, c)

    def sft_parts(self, examples: tuple[SFTExample, ...]) -> SFTParts:
        dev = self.logprobs.device
        c = collate(
            [e.prompt_ids for e in examples],
            [e.completion_ids for e in examples],
            self.logprobs.pad_id,
        )
        mask = completion_mask(c.completion_ids, c.lengths).to(dev)
        slices = self._slices(len(examples))
        scale = None if len(slices) == 1 else token_mean_scale(mask).to(dev)
        return SFTParts(c, mask, scale, slices, self.share.passes(len(slices)))

    # ---- one pass's losses --------------------------------------------------------------------
    def grpo_loss(self, model: torch.nn.Module, parts: GRPOParts, i: int, weights: torch.Tensor):
        """Pass ``i``'s GRPO loss (its micro-batch's share of the batch's) and its log-prob
        entropy (pass i runs micro-batch i on one rank)."""
        g, s, dev = self.grpo, parts.slices[parts.micro_batch(i)], self.logprobs.device
        c = parts.collated if parts.scales is None else take_rows(parts.collated, s)
        logp, ent = self.logprobs.token_logprobs(model, c)
        old_i = parts.old[s]  # a view: what is filled in here stays for the later iterations
        # Rows without behaviour log-probs (peer samples) take the policy's own before this
        # update, at the first pass, and keep them: ratio 1 on the first iteration and clipped
        # on the later ones, as own rows are; their off-policy correction travels in ``weights``.
        # (in place, without asking the device whether any is missing: no sync a pass)
        old_i.copy_(torch.where(torch.isnan(old_i), logp.detach(), old_i))
        sampler = c.seq.sampler_weights  # (B_mb, T) mismatch weights of the policy term, or None
        out = clipped_surrogate(
            logp,
            old_i,
            c.seq.advantages.to(dev),
            parts.mask[s],
            SurrogateSettings(
                epsilon=g.epsilon,
                epsilon_high=g.epsilon_high,
                loss_type=g.loss_type,
                max_completion_length=g.max_completion_length,
                beta=g.beta,
                importance_sampling_level=g.importance_sampling_level,
                use_bias_correction_kl=g.use_bias_correction_kl,
            ),
            ref_logp=parts.ref[i],
            sample_weight=weights[s].to(dev),
            sampler_weight=None if sampler is None else sampler.to(dev),
            share=LossShare(
                row_scale=None if parts.scales is None else parts.scales[s],
                skipped_rows=parts.skipped_rows,
                skipped_tokens=parts.skipped_tokens,
            ),
        )
        return out, ent

    def sft_loss(self, model: torch.nn.Module, parts: SFTParts, i: int) -> torch.Tensor:
        """Pass ``i``'s micro-batch's share of the mean token NLL over all SFT examples."""
        s = parts.slices[parts.passes[i][0]]
        c = parts.collated if parts.scale is None else take_rows(parts.collated, s)
        logp, _ = self.logprobs.token_logprobs(model, c, temperature=1.0, entropy=False)
        mask = parts.mask[s]
        if parts.scale is None:
            return -(logp * mask).sum() / mask.sum().clamp(min=1)
        return -(logp * mask).sum() * parts.scale

    def sft_total_loss(
        self, model: torch.nn.Module, examples: tuple[SFTExample, ...]
    ) -> torch.Tensor | int:
        """Mean token NLL of ``examples`` over this rank's micro-batches (all of them on one
        rank; differentiable); 0 on a rank with padding passes only."""
        parts = self.sft_parts(examples)
        total = sum(
            self.sft_loss(model, parts, k) for k, (_, real) in enumerate(parts.passes) if real
        )
        return total

    # ---- one optimizer step's gradients -------------------------------------------------------
    def backward(
        self, model: torch.nn.Module, grpo: GRPOParts | None, sft: SFTParts | None, coef: float
    ) -> Gradients:
        """Accumulate one optimizer step's gradients into ``model``: pass k backpropagates GRPO
        micro-batch k plus ``coef`` x SFT micro-batch k (with one of each, exactly the single
        pass's loss). A rank of a sharded learner runs its own passes (``policies.ranks``); its
        padding passes count for nothing."""
        g_passes = grpo.passes if grpo is not None else []
        s_passes = sft.passes if sft is not None else []
        means = {k: _Mean() for k in ("kl", "clip_ratio_low", "clip_ratio_high", "entropy")}
        sums: dict[str, list[torch.Tensor]] = {"grpo_loss": [], "sft_loss": [], "loss": []}
        present, finite = False, True
        for k in range(max(len(g_passes), len(s_passes), 1)):
            loss = torch.zeros((), device=self.logprobs.device)
            if grpo is not None and k < len(g_passes):
                out, ent = self.grpo_loss(model, grpo, k, grpo.collated.seq.weights)
                if g_passes[k][1]:
                    loss = loss + out.loss
                    _grpo_stats(means, sums, grpo.mask[grpo.slices[g_passes[k][0]]], out, ent)
                else:
                    loss = loss + out.loss * 0.0
            if sft is not None and k < len(s_passes):
                part = self.sft_loss(model, sft, k)
                if s_passes[k][1]:
                    loss = loss + coef * part
                    sums["sft_loss"].append(part.detach())
                else:
                    loss = loss + part * 0.0
            sums["loss"].append(loss.detach())
            if not torch.isfinite(loss):
                finite = False
                if self.share.stops_early:
                    break  # with several ranks every pass still runs: each is a collective
            if loss.requires_grad:
                loss.backward()
                present = True
        stats = self._merge_stats(means, sums)
        return Gradients(stats, self.share.all_finite(finite), self.share.any(present))

    def _merge_stats(
        self, means: dict[str, _Mean], sums: dict[str, list[torch.Tensor]]
    ) -> dict[str, float]:
        """The step's statistics: token-weighted means and sums over every rank's passes."""
        stats: dict[str, float]
        if self.share.world == 1:
            stats = {k: m.value() for k, m in means.items() if m.parts}
            stats.update(
                {k: float(sum(v)) if len(v) > 1 else float(v[0]) for k, v in sums.items() if v}
            )
            return stats
        # per mean: (sum of value x tokens, tokens, parts); per sum: (sum, parts)
        local = [
            x
            for m in means.values()
            for x in (
                sum((float(v.double() * t) for v, t in m.parts), 0.0),
                sum((float(t) for _, t in m.parts), 0.0),
                float(len(m.parts)),
            )
        ]
        local += [x for v in sums.values() for x in (sum(float(t) for t in v), float(len(v)))]
        total = self.share.sum(torch.tensor(local, dtype=torch.float64)).tolist()
        stats = {}
        for j, k in enumerate(means):
            weighted, tokens, parts = total[3 * j : 3 * j + 3]
            if parts:
                stats[k] = weighted / max(tokens, 1.0)
        for j, k in enumerate(sums):
            value, parts = total[3 * len(means) + 2 * j : 3 * len(means) + 2 * j + 2]
            if parts:
                stats[k] = value
        return stats

    def source_gradients(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, parts: GRPOParts
    ) -> dict[str, float]:
        """Gradient norms of the own and the peer samples' loss terms, and their cosine; the
        model's gradients are cleared through ``optimizer`` before, between and after.

        Each part keeps the full batch's normaliser (rows of the other source weighted 0), so
        the two gradients sum to the gradient of the full loss. A sharded learner's ranks each
        hold a shard of both gradients: their dot products are summed over the ranks.
        """
        is_peer = parts.collated.seq.is_peer
        grads = []
        for keep in (~is_peer, is_peer):
            optimizer.zero_grad(set_to_none=True)
            w = parts.collated.seq.weights  # (B,), or (B, T) with token weights
            for k, (_, real) in enumerate(parts.passes):
                out, _ = self.grpo_loss(
                    model, parts, k, w * keep.float().view(-1, *[1] * (w.dim() - 1))
                )
                (out.loss if real else out.loss * 0.0).backward()
            # read after backward: a sharded model registers its sharded parameters again only
            # then (after a forward its root holds gathered ones)
            params = [q for q in model.parameters() if q.requires_grad]
            grads.append(
                torch.cat(
                    [
                        _local(q.grad if q.grad is not None else torch.zeros_like(q)).flatten()
                        for q in params
                    ]
                )
            )
        optimizer.zero_grad(set_to_none=True)
        own, peer = grads
        if self.share.world > 1:
            dots = self.share.sum(torch.stack([own @ own, peer @ peer, own @ peer]).double())
            own_norm, peer_norm = float(dots[0].sqrt()), float(dots[1].sqrt())
            cos = float(dots[2]) / max(own_norm * peer_norm, 1e-8) if peer_norm > 0 else 0.0
            return {
                "grad/own_norm": own_norm,
                "grad/peer_norm": peer_norm,
                "grad/own_peer_cosine": cos,
            }
        similarity = (
            torch.nn.functional.cosine_similarity(own, peer, dim=0)
            if peer.norm() > 0
            else torch.tensor(0.0)
        )
        return {
            "grad/own_norm": float(own.norm()),
            "grad/peer_norm": float(peer.norm()),
            "grad/own_peer_cosine": float(similarity),
        }


def _grpo_stats(means, sums, mask, out, ent) -> None:
    with torch.no_grad():
        tokens = mask.sum()
        # the positions whose entropy was computed (all, or training.entropy_sample_size)
        picked = mask.bool() & ~torch.isnan(ent)
        mean = ent[picked].mean() if bool(picked.any()) else torch.zeros(())
        means["entropy"].add(mean, tokens)
    means["kl"].add(out.kl, tokens)
    means["clip_ratio_low"].add(out.clip_low_frac, tokens)
    means["clip_ratio_high"].add(out.clip_high_frac, tokens)
    sums["grpo_loss"].append(out.loss.detach())


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded (DTensor) gradient; a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t
