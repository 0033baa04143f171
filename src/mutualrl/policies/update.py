"""The update engine: how a policy turns a ``TrainBatch`` into optimizer steps within bounded memory.

Each ``TrainBatch`` is one optimizer step per ``num_iterations``. The engine collates it once,
computes everything that depends on the whole batch once (masks, the loss normalisers of
``grpo.normalise``, reference log-probs), and cuts its rows into micro-batches
(``per_device_train_batch_size`` / ``gradient_accumulation_steps``) whose gradients accumulate
into that one step: for every ``loss_type``, with SFT terms, importance weights and the KL term,
the step equals the single pass up to float rounding. A micro-batch with more completion
positions than ``logprob_chunk_size`` takes its log-probs from the final hidden states through
``grpo.chunked_token_logprobs``, so no (rows, T, V) logits exist.

With neither option set (the default) there is one micro-batch and it runs exactly the code of
the single pass, bit for bit.

Precision: ``dtype = "bf16"`` runs forward under ``torch.autocast`` (bf16) with fp32 weights and
AdamW moments; a sharded learner gets the same from FSDP2's mixed-precision policy instead
(``policies.sharded.fsdp``). A learner of several ranks runs its share of each step's
micro-batches (``policies.ranks``); the gradient is the one-rank gradient.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from dataclasses import dataclass, field, replace

import torch

from mutualrl.config import GRPOConfig, PolicyConfig, TrainingConfig
from mutualrl.grpo import (LossShare, SurrogateSettings, chunked_token_logprobs, clipped_surrogate,
                           completion_mask, row_scales, sampled_entropy, selective_log_softmax,
                           token_logprobs, token_mean_scale)
from mutualrl.policies.batch import Collated, SFTExample, TrainBatch, collate, collate_sequences
from mutualrl.policies.generation.mismatch import correct_mismatch
from mutualrl.policies.ranks import Pass


# ---- pure helpers -----------------------------------------------------------------------------
def micro_batch_slices(rows: int, per_device_train_batch_size: int | None,
                       gradient_accumulation_steps: int, multiple: int = 1) -> list[slice]:
    """Cut ``rows`` into max(gradient_accumulation_steps, ceil(rows / per_device)) near-equal
    consecutive slices, that count rounded up to a ``multiple`` (a sharded learner's ranks),
    never more slices than rows, at least one."""
    n = gradient_accumulation_steps
    if per_device_train_batch_size is not None:
        n = max(n, math.ceil(rows / per_device_train_batch_size))
    n = math.ceil(n / multiple) * multiple
    n = max(1, min(n, rows))
    base, extra = divmod(rows, n)
    bounds = [0]
    for i in range(n):
        bounds.append(bounds[-1] + base + (i < extra))
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


def take_rows(c: Collated, rows: slice) -> Collated:
    """Rows of a collated batch, without the leading columns that are padding in all of them
    (left padding only: positions and the completion's last-T layout are unchanged)."""
    attention = c.attention_mask[rows]
    used = attention.any(0).nonzero()
    first = min(int(used[0]) if len(used) else 0, c.input_ids.shape[1] - c.completion_len - 1)
    first = max(first, 0)
    return replace(c, input_ids=c.input_ids[rows, first:], attention_mask=attention[:, first:],
                   position_ids=c.position_ids[rows, first:], completion_ids=c.completion_ids[rows],
                   lengths=c.lengths[rows],
                   columns=c.columns.rows(rows) if c.columns is not None else None)


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


def make_optimizer(model: torch.nn.Module, cfg: PolicyConfig, grpo: GRPOConfig,
                   training: TrainingConfig, total_steps: int | None):
    """AdamW and its learning-rate schedule (transformers.get_scheduler).

    ``total_steps``: optimizer steps the schedule spans (the run's steps x num_iterations);
    needed by every schedule but "constant"."""
    from transformers import get_scheduler

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                  lr=cfg.learning_rate or grpo.learning_rate,
                                  weight_decay=training.weight_decay)
    if total_steps is None and training.lr_scheduler_type != "constant":
        raise ValueError(f"policy {cfg.name!r}: training.lr_scheduler_type = "
                         f"{training.lr_scheduler_type!r} needs the run's number of optimizer steps "
                         "(total_steps), which was not given")
    total = max(int(total_steps or 1), 1)
    scheduler = get_scheduler(training.lr_scheduler_type, optimizer,
                              num_warmup_steps=math.ceil(total * training.warmup_ratio),
                              num_training_steps=total)
    return optimizer, scheduler


def prepare_model(model: torch.nn.Module, training: TrainingConfig) -> None:
    """HF gradient checkpointing, non-reentrant (no inputs need requires_grad; works with LoRA)."""
    if training.gradient_checkpointing:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
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

    c: Collated
    mask: torch.Tensor                      # (B, T) on the device
    old: torch.Tensor                       # (B, T) behaviour log-probs, NaN where none
    ref: list[torch.Tensor | None]          # per micro-batch (B_mb, T) reference log-probs
    scales: torch.Tensor | None             # (B,) row normalisers; None: one micro-batch
    slices: list[slice]
    stats: dict[str, float] = field(default_factory=dict)
    skipped_rows: int = 0                   # zero-loss rows the strategy left out (normaliser)
    skipped_tokens: int = 0  # the sampler/trainer mismatch, if corrected
    # This rank's passes (``policies.ranks``): pass k runs micro-batch passes[k][0], its reference
    # log-probs are ref[k]. None: pass k runs micro-batch k (one rank).
    passes: list[Pass] | None = None

    def __post_init__(self) -> None:
        if self.passes is None:
            self.passes = [(k, True) for k in range(len(self.slices))]

    def micro_batch(self, k: int) -> int:
        return self.passes[k][0]


@dataclass
class SFTParts:
    c: Collated
    mask: torch.Tensor                      # (B, T) on the device
    scale: torch.Tensor | None              # 1 / all SFT tokens; None: one micro-batch
    slices: list[slice]
    passes: list[Pass] | None = None        # as GRPOParts.passes

    def __post_init__(self) -> None:
        if self.passes is None:
            self.passes = [(k, True) for k in range(len(self.slices))]


class UpdateEngine:
    """How a learner's batches become optimizer steps (``Learner.train_step``, ``sft_step``,
    ``sequence_logprobs``). It changes the learner's state (weights, optimizer, schedule, version,
    skipped-step count) and owns none of it."""

    def __init__(self, learner) -> None:
        self.p = learner
        self.grpo: GRPOConfig = learner.grpo
        self.training: TrainingConfig = learner.training
        # The rank's share of each step (one rank: everything); a sharded model casts to bf16
        # itself (FSDP2's mixed precision), so only an unsharded one runs under autocast.
        self.share = learner.placement.share
        self.bf16 = learner.cfg.dtype == "bf16" and learner.placement.autocast

    def autocast(self):
        """The policy's compute precision for a forward pass (backward follows it)."""
        if not self.bf16:
            return contextlib.nullcontext()
        return torch.autocast(self.p.device.type, dtype=torch.bfloat16)

    def _slices(self, rows: int, split: bool = True) -> list[slice]:
        """Micro-batches of ``rows``; ``split``: a count the ranks share evenly (gradient passes;
        passes without gradient run every micro-batch on every rank)."""
        t = self.training
        return micro_batch_slices(rows, t.per_device_train_batch_size, t.gradient_accumulation_steps,
                                  self.share.world if split else 1)

    # ---- log-probs ----------------------------------------------------------------------------
    def _chunked(self, c: Collated) -> bool:
        size = self.training.logprob_chunk_size
        return size is not None and c.input_ids.shape[0] * c.completion_len > size

    def _hidden_logprobs(self, c: Collated, model, temperature: float):
        """(B, T) log-probs and entropy from final hidden states, the LM head chunked."""
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        head = base.get_output_embeddings()
        if type(head) is not torch.nn.Linear or getattr(base.config, "final_logit_softcapping", None):
            raise ValueError(f"training.logprob_chunk_size: policy {self.p.name!r} has an LM head "
                             f"({type(head).__name__}) that is not a plain linear layer; "
                             "unset logprob_chunk_size for it")
        dev, L, T = self.p.device, c.input_ids.shape[1], c.completion_len
        out = base.get_decoder()(input_ids=c.input_ids.to(dev), attention_mask=c.attention_mask.to(dev),
                                 position_ids=c.position_ids.to(dev), use_cache=False)
        hidden = out.last_hidden_state[:, L - T - 1:L - 1]                    # (B, T, H)
        return chunked_token_logprobs(hidden, head.weight, head.bias, c.completion_ids.to(dev),
                                      temperature, self.training.logprob_chunk_size)

    def token_logprobs(self, c: Collated, model=None, temperature: float | None = None,
                       entropy: bool = True):
        """Differentiable (B, T) log-probs of the completion tokens, and (B, T) entropy (no grad;
        None when not asked for and not free)."""
        model = model or self.p.model
        with self.autocast():
            if self._chunked(c):
                return self._hidden_logprobs(c, model, temperature or self.grpo.temperature)
            # temperature None: the sampling distribution, top_k/top_p truncation included
            logits = self.p.completion_logits(c, model, temperature=temperature)
            logp, logp_all = token_logprobs(logits, c.completion_ids.to(self.p.device))
        if not entropy:
            return logp, None
        valid = completion_mask(c.completion_ids, c.lengths).to(logp_all.device)
        return logp, sampled_entropy(logp_all, valid, self.training.entropy_sample_size)

    @torch.no_grad()
    def plain_logprobs(self, c: Collated, model=None) -> torch.Tensor:
        """(B, T) log-probs, not differentiated (behaviour, reference, off-policy ratios)."""
        with self.autocast():
            if self._chunked(c):
                return self._hidden_logprobs(c, model or self.p.model, self.grpo.temperature)[0]
            logits = self.p.completion_logits(c, model)
            return selective_log_softmax(logits, c.completion_ids.to(self.p.device))

    @torch.no_grad()
    def sequence_logprobs(self, prompts, completions) -> torch.Tensor:
        """Total log-prob of each completion under the current policy: (B,), per micro-batch."""
        self.p.model.eval()
        c = collate(prompts, completions, self.p.pad_id)
        mask = completion_mask(c.completion_ids, c.lengths)
        slices = self._slices(len(prompts), split=False)
        if len(slices) == 1:
            return (self.plain_logprobs(c).cpu() * mask).sum(-1)
        return torch.cat([(self.plain_logprobs(take_rows(c, s)).cpu() * mask[s]).sum(-1)
                          for s in slices])

    @torch.no_grad()
    def batch_logprobs(self, c: Collated) -> torch.Tensor:
        """(B, T) log-probs of a whole collated batch, computed micro-batch by micro-batch."""
        slices = self._slices(c.input_ids.shape[0], split=False)
        if len(slices) == 1:
            return self.plain_logprobs(c)
        return torch.cat([self.plain_logprobs(take_rows(c, s)) for s in slices])

    def _reference_logp(self, c: Collated) -> torch.Tensor | None:
        if self.grpo.beta == 0:
            return None
        if self.p.reference is not None:
            return self.plain_logprobs(c, self.p.reference)
        with self.p.model.disable_adapter():
            return self.plain_logprobs(c)

    # ---- the batch's parts, once per optimizer step -------------------------------------------
    def _grpo_parts(self, batch: TrainBatch, inexact_sampler: bool = False) -> GRPOParts:
        g, dev = self.grpo, self.p.device
        c = collate_sequences(batch.sequences, self.p.pad_id)
        # An inexact sampler (vLLM): recompute the behaviour log-probs, weight by the IS ratio.
        mismatch = correct_mismatch(c, g, self.batch_logprobs) if inexact_sampler else {}
        mask = completion_mask(c.completion_ids, c.lengths, c.seq.truncated,
                               g.mask_truncated_completions).to(dev)
        slices = self._slices(len(batch.sequences))
        one = len(slices) == 1
        passes = self.share.passes(len(slices))
        ref = [self._reference_logp(c if one else take_rows(c, slices[i])) for i, _ in passes]
        scales = None if one else row_scales(mask, g.loss_type, g.max_completion_length,
                                             batch.skipped_rows, batch.skipped_tokens).to(dev)
        # a copy: grpo_loss fills the peer rows' missing log-probs into it
        return GRPOParts(c, mask, c.seq.old_logprobs.to(dev, copy=True), ref, scales, slices, mismatch,
                         batch.skipped_rows, batch.skipped_tokens, passes)

    def _sft_parts(self, examples: tuple[SFTExample, ...]) -> SFTParts:
        c = collate([e.prompt_ids for e in examples], [e.completion_ids for e in examples], self.p.pad_id)
        mask = completion_mask(c.completion_ids, c.lengths).to(self.p.device)
        slices = self._slices(len(examples))
        scale = None if len(slices) == 1 else token_mean_scale(mask).to(self.p.device)
        return SFTParts(c, mask, scale, slices, self.share.passes(len(slices)))

    # ---- one micro-batch's losses ---------------------------------------------------------------
    def grpo_loss(self, parts: GRPOParts, i: int, weights: torch.Tensor):
        """Pass ``i``'s GRPO loss (its micro-batch's share of the batch's) and its log-prob
        entropy (pass i runs micro-batch i on one rank)."""
        g, s = self.grpo, parts.slices[parts.micro_batch(i)]
        c = parts.c if parts.scales is None else take_rows(parts.c, s)
        logp, ent = self.token_logprobs(c)
        old_i = parts.old[s]   # a view: what is filled in here stays for the later iterations
        # Rows without behaviour log-probs (peer samples) take the policy's own before this
        # update, at the first pass, and keep them: ratio 1 on the first iteration and clipped
        # on the later ones, as own rows are; their off-policy correction travels in ``weights``.
        # (in place, without asking the device whether any is missing: no sync a pass)
        old_i.copy_(torch.where(torch.isnan(old_i), logp.detach(), old_i))
        sampler = c.seq.sampler_weights     # (B_mb, T) mismatch weights of the policy term, or None
        out = clipped_surrogate(
            logp, old_i, c.seq.advantages.to(self.p.device), parts.mask[s],
            SurrogateSettings(epsilon=g.epsilon, epsilon_high=g.epsilon_high, loss_type=g.loss_type,
                              max_completion_length=g.max_completion_length, beta=g.beta,
                              importance_sampling_level=g.importance_sampling_level,
                              use_bias_correction_kl=g.use_bias_correction_kl),
            ref_logp=parts.ref[i], sample_weight=weights[s].to(self.p.device),
            sampler_weight=None if sampler is None else sampler.to(self.p.device),
            share=LossShare(row_scale=None if parts.scales is None else parts.scales[s],
                            skipped_rows=parts.skipped_rows, skipped_tokens=parts.skipped_tokens))
        return out, ent

    def sft_total_loss(self, examples: tuple[SFTExample, ...]) -> torch.Tensor:
        """Mean token NLL of ``examples`` over this rank's micro-batches (all of them on one
        rank; differentiable)."""
        parts = self._sft_parts(examples)
        return sum(self.sft_loss(parts, k) for k, (_, real) in enumerate(parts.passes) if real)

    def sft_loss(self, parts: SFTParts, i: int) -> torch.Tensor:
        """Pass ``i``'s micro-batch's share of the mean token NLL over all SFT examples."""
        s = parts.slices[parts.passes[i][0]]
        c = parts.c if parts.scale is None else take_rows(parts.c, s)
        logp, _ = self.token_logprobs(c, temperature=1.0, entropy=False)
        mask = parts.mask[s]
        if parts.scale is None:
            return -(logp * mask).sum() / mask.sum().clamp(min=1)
        return -(logp * mask).sum() * parts.scale

    # ---- optimizer steps ------------------------------------------------------------------------
    def train_step(self, batch: TrainBatch, inexact_sampler: bool = False) -> dict[str, float]:
        """One update (``num_iterations`` optimizer steps) on a batch; NaN losses are skipped,
        counted. The schedule advances once per optimizer step at the policy's learning rate
        (not for a batch that sets its own). ``inexact_sampler``: correct the behaviour log-probs
        (``generation.mismatch``)."""
        p = self.p
        p.model.train()
        stats, t0 = {}, time.perf_counter()
        grpo = self._grpo_parts(batch, inexact_sampler) if batch.sequences else None
        sft = self._sft_parts(batch.sft) if batch.sft and batch.sft_coef > 0 else None
        if grpo is not None:
            stats.update(grpo.stats)
        if grpo is not None and batch.diagnose_sources:
            stats.update(self._source_gradients(grpo))
        for _ in range(self.grpo.num_iterations):
            stats.update(self._iteration(grpo, sft, batch.sft_coef))
            if batch.learning_rate is None:
                self._advance_schedule()
        p.version += 1
        stats["step_time_s"] = time.perf_counter() - t0
        return stats

    def _advance_schedule(self) -> None:
        # The schedule counts update attempts, skipped ones too (as transformers' Trainer does),
        # so a run's rates do not depend on which steps were skipped; torch warns when a
        # skipped step precedes it (or optimizer.step is wrapped), which is intended here.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)`")
            warnings.filterwarnings("ignore", message=r"Seems like `optimizer\.step\(\)` has been overridden")
            self.p.scheduler.step()

    def _iteration(self, grpo: GRPOParts | None, sft: SFTParts | None, coef: float) -> dict[str, float]:
        """One optimizer step: pass k backpropagates GRPO micro-batch k plus SFT micro-batch k
        (with one of each, exactly the single pass's loss). A rank of a sharded learner runs its
        own passes (``policies.ranks``); its padding passes count for nothing."""
        self.p.optimizer.zero_grad(set_to_none=True)
        g_passes = grpo.passes if grpo is not None else []
        s_passes = sft.passes if sft is not None else []
        n = max(len(g_passes), len(s_passes), 1)
        means = {k: _Mean() for k in ("kl", "clip_ratio_low", "clip_ratio_high", "entropy")}
        sums: dict[str, list[torch.Tensor]] = {"grpo_loss": [], "sft_loss": [], "loss": []}
        grads, finite = False, True
        for k in range(n):
            loss = torch.zeros((), device=self.p.device)
            if k < len(g_passes):
                out, ent = self.grpo_loss(grpo, k, grpo.c.seq.weights)
                if g_passes[k][1]:
                    loss = loss + out.loss
                    self._grpo_stats(means, sums, grpo.mask[grpo.slices[g_passes[k][0]]], out, ent)
                else:
                    loss = loss + out.loss * 0.0
            if k < len(s_passes):
                part = self.sft_loss(sft, k)
                if s_passes[k][1]:
                    loss = loss + coef * part
                    sums["sft_loss"].append(part.detach())
                else:
                    loss = loss + part * 0.0
            sums["loss"].append(loss.detach())
            if not torch.isfinite(loss):
                finite = False
                if self.share.stops_early:
                    break   # with several ranks every pass still runs: each is a collective
            if loss.requires_grad:
                loss.backward()
                grads = True
        stats = self._merge_stats(means, sums)
        finite, grads = self.share.all_finite(finite), self.share.any(grads)
        stats.update(self._optimizer_step(stats["loss"], grads) if finite else self._skip(float("nan")))
        return stats

    def _merge_stats(self, means: dict[str, _Mean], sums: dict[str, list[torch.Tensor]]) -> dict[str, float]:
        """The step's statistics: token-weighted means and sums over every rank's passes."""
        if self.share.world == 1:
            stats = {k: m.value() for k, m in means.items() if m.parts}
            stats.update({k: float(sum(v)) if len(v) > 1 else float(v[0]) for k, v in sums.items() if v})
            return stats
        # per mean: (sum of value x tokens, tokens, parts); per sum: (sum, parts)
        local = [x for m in means.values() for x in (
            sum((float(v.double() * t) for v, t in m.parts), 0.0),
            sum((float(t) for _, t in m.parts), 0.0), float(len(m.parts)))]
        local += [x for v in sums.values() for x in (sum(float(t) for t in v), float(len(v)))]
        total = self.share.sum(torch.tensor(local, dtype=torch.float64)).tolist()
        stats: dict[str, float] = {}
        for j, k in enumerate(means):
            weighted, tokens, parts = total[3 * j:3 * j + 3]
            if parts:
                stats[k] = weighted / max(tokens, 1.0)
        for j, k in enumerate(sums):
            value, parts = total[3 * len(means) + 2 * j:3 * len(means) + 2 * j + 2]
            if parts:
                stats[k] = value
        return stats

    @staticmethod
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

    def _skip(self, loss: float) -> dict[str, float]:
        self.p.optimizer.zero_grad(set_to_none=True)
        self.p.skipped_nan_steps += 1
        return {"loss": loss, "skipped_nan": 1.0}

    def _optimizer_step(self, loss: float, grads: bool) -> dict[str, float]:
        """Clip and step on the accumulated gradients; a non-finite norm skips the step."""
        p = self.p
        if not grads:
            # nothing in the batch depends on the parameters (no sequences, SFT weight 0)
            return {"loss": loss, "skipped_empty": 1.0}
        params = [q for q in p.model.parameters() if q.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, self.training.max_grad_norm or math.inf)
        if hasattr(norm, "full_tensor"):   # sharded gradients: the norm is a replicated DTensor
            norm = norm.full_tensor()
        if not torch.isfinite(norm):
            return self._skip(loss)
        p.optimizer.step()
        return {"loss": loss, "grad_norm": float(norm), "skipped_nan": 0.0}

    def sft_step(self, examples: tuple[SFTExample, ...]) -> float:
        """A plain supervised step at the optimizer's current learning rate (schedule not advanced)."""
        self.p.model.train()
        stats = self._iteration(None, self._sft_parts(examples), 1.0)
        return stats.get("sft_loss", stats["loss"])

    def _source_gradients(self, parts: GRPOParts) -> dict[str, float]:
        """Gradient norms of the own and the peer samples' loss terms, and their cosine.

        Each part keeps the full batch's normaliser (rows of the other source weighted 0), so
        the two gradients sum to the gradient of the full loss. A sharded learner's ranks each
        hold a shard of both gradients: their dot products are summed over the ranks.
        """
        p = self.p
        is_peer = parts.c.seq.is_peer
        grads = []
        for keep in (~is_peer, is_peer):
            p.optimizer.zero_grad(set_to_none=True)
            w = parts.c.seq.weights                 # (B,), or (B, T) with token weights
            for k, (_, real) in enumerate(parts.passes):
                out, _ = self.grpo_loss(parts, k, w * keep.float().view(-1, *[1] * (w.dim() - 1)))
                (out.loss if real else out.loss * 0.0).backward()
            # read after backward: a sharded model registers its sharded parameters again only
            # then (after a forward its root holds gathered ones)
            params = [q for q in p.model.parameters() if q.requires_grad]
            grads.append(torch.cat([_local(q.grad if q.grad is not None else torch.zeros_like(q)).flatten()
                                    for q in params]))
        p.optimizer.zero_grad(set_to_none=True)
        own, peer = grads
        if self.share.world > 1:
            dots = self.share.sum(torch.stack([own @ own, peer @ peer, own @ peer]).double())
            own_norm, peer_norm = float(dots[0].sqrt()), float(dots[1].sqrt())
            cos = float(dots[2]) / max(own_norm * peer_norm, 1e-8) if peer_norm > 0 else 0.0
            return {"grad/own_norm": own_norm, "grad/peer_norm": peer_norm, "grad/own_peer_cosine": cos}
        cos = torch.nn.functional.cosine_similarity(own, peer, dim=0) if peer.norm() > 0 else torch.tensor(0.0)
        return {"grad/own_norm": float(own.norm()), "grad/peer_norm": float(peer.norm()),
                "grad/own_peer_cosine": float(cos)}


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded (DTensor) gradient; a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t
