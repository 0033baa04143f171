"""Training data in one policy's own tokenization, and its collation into padded tensors.

Strategies build ``TrainBatch``es out of ``TrainSequence``s (own samples, pooled peer samples,
SFT examples); the policy turns them into tensors. Layout: prompts left-padded, completions
right-padded after them, so every completion occupies the last T positions and the model only
has to produce logits there (``logits_to_keep``) — with 32k-129k vocabularies the LM head is
most of a tiny model's cost. A collated batch is cut into micro-batches of consecutive rows
(``micro_batch_slices``, ``take_rows``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class TrainSequence:
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]  # includes EOS when the completion stopped
    advantage: float
    # Behaviour log-probs per completion token in *this* policy's tokenization; None when the
    # sample came from elsewhere (a peer): then the policy's own before the update stand in (taken
    # at its first pass and kept for its later iterations), and any off-policy correction travels
    # in ``weight``.
    old_logprobs: tuple[float, ...] | None = None
    weight: float = 1.0
    # Per-token weights (one per completion token) of a token-level off-policy correction,
    # multiplying ``weight``; None: 1 on every token.
    token_weights: tuple[float, ...] | None = None
    truncated: bool = False
    source: str = ""  # producing policy; "" for the policy itself
    # Version of the weights that sampled it (own samples): behind the learner's version when
    # generation overlapped an update (``allocation.async_generation``), and then corrected as an
    # inexact sampler's are. None: unknown (peers, SFT), never corrected for staleness.
    behaviour_version: int | None = None


@dataclass(frozen=True)
class SFTExample:
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    source: str = ""


@dataclass(frozen=True)
class TrainBatch:
    """One optimizer update: GRPO on ``sequences`` plus ``sft_coef`` x mean-token NLL on ``sft``."""

    sequences: tuple[TrainSequence, ...] = ()
    sft: tuple[SFTExample, ...] = ()
    sft_coef: float = 0.0
    tag: str = "grpo"  # "grpo" or "sft" (an SFT-only step), for metrics
    learning_rate: float | None = None  # this update's learning rate (None: the policy's)
    # Report the own-sample and peer-sample gradient norms and their cosine before updating
    # (two extra backward passes; the two parts sum to the full GRPO gradient).
    diagnose_sources: bool = False
    # Sequences a strategy left out because their loss terms are exactly 0 (weight 0, or advantage
    # 0 without KL): they still count in the loss normaliser — rows for grpo/dr_grpo, masked
    # completion tokens for dapo — so the loss and its gradient equal those of the full batch.
    skipped_rows: int = 0
    skipped_tokens: int = 0


def stale_rows(batch: TrainBatch, version: int) -> bool:
    """Whether ``batch`` holds own samples drawn by weights older than ``version``."""
    return any(
        s.behaviour_version is not None and s.behaviour_version < version for s in batch.sequences
    )


@dataclass
class SequenceColumns:
    """Per-row tensors of a collated GRPO batch: what the loss needs besides the token ids.

    Mutable: the mismatch correction (``generation.mismatch``) replaces ``old_logprobs`` and sets
    ``sampler_weights`` once per update, before any micro-batch is cut."""

    advantages: torch.Tensor  # (B,) fp32
    weights: torch.Tensor  # (B,) fp32 per-sequence loss weights, or (B, T) with token weights
    truncated: torch.Tensor  # (B,) bool: cut at max_completion_length
    has_old: torch.Tensor  # (B,) bool: behaviour log-probs present (own samples)
    old_logprobs: torch.Tensor  # (B, T) fp32 behaviour log-probs, NaN where none (peers)
    is_peer: torch.Tensor  # (B,) bool: produced by another policy
    # (B, T) fp32 sampler/trainer mismatch weights of the policy term only (not the KL, as TRL);
    # None: no correction (an exact sampler, or the correction switched off)
    sampler_weights: torch.Tensor | None = None

    def rows(self, rows: slice) -> SequenceColumns:
        # every field by name: a required field added to the class and not here fails mypy
        sampler = self.sampler_weights
        return SequenceColumns(
            advantages=self.advantages[rows],
            weights=self.weights[rows],
            truncated=self.truncated[rows],
            has_old=self.has_old[rows],
            old_logprobs=self.old_logprobs[rows],
            is_peer=self.is_peer[rows],
            sampler_weights=None if sampler is None else sampler[rows],
        )


@dataclass(frozen=True)
class Collated:
    input_ids: torch.Tensor  # (B, P+T)
    attention_mask: torch.Tensor  # (B, P+T)
    position_ids: torch.Tensor  # (B, P+T)
    completion_ids: torch.Tensor  # (B, T)
    lengths: torch.Tensor  # (B,)
    columns: SequenceColumns | None = None  # GRPO batches only (``collate_sequences``)

    @property
    def completion_len(self) -> int:
        return self.completion_ids.shape[1]

    @property
    def seq(self) -> SequenceColumns:
        """The GRPO columns (an SFT or log-prob batch has none)."""
        if self.columns is None:
            raise ValueError("this batch was collated without GRPO columns (collate_sequences)")
        return self.columns


def collate(
    prompts: list[tuple[int, ...]], completions: list[tuple[int, ...]], pad_id: int
) -> Collated:
    B = len(prompts)
    P = max(len(p) for p in prompts)
    T = max(max(len(c) for c in completions), 1)
    input_ids = torch.full((B, P + T), pad_id, dtype=torch.long)
    attention = torch.zeros((B, P + T), dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        input_ids[i, P - len(p) : P] = torch.tensor(p, dtype=torch.long)
        attention[i, P - len(p) : P] = 1
        if c:
            input_ids[i, P : P + len(c)] = torch.tensor(c, dtype=torch.long)
            attention[i, P : P + len(c)] = 1
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    lengths = torch.tensor([len(c) for c in completions], dtype=torch.long)
    return Collated(input_ids, attention, position_ids, input_ids[:, P:], lengths)


def collate_sequences(seqs: tuple[TrainSequence, ...], pad_id: int) -> Collated:
    c = collate([s.prompt_ids for s in seqs], [s.completion_ids for s in seqs], pad_id)
    T = c.completion_len
    old = torch.full((len(seqs), T), float("nan"))
    for i, s in enumerate(seqs):
        if s.old_logprobs is not None:
            old[i, : len(s.old_logprobs)] = torch.tensor(s.old_logprobs)
    return replace(
        c,
        columns=SequenceColumns(
            advantages=torch.tensor([s.advantage for s in seqs], dtype=torch.float32),
            weights=sequence_weights(seqs, T),
            truncated=torch.tensor([s.truncated for s in seqs], dtype=torch.bool),
            has_old=torch.tensor([s.old_logprobs is not None for s in seqs], dtype=torch.bool),
            old_logprobs=old,
            is_peer=torch.tensor([bool(s.source) for s in seqs], dtype=torch.bool),
        ),
    )


def sequence_weights(seqs: tuple[TrainSequence, ...], T: int) -> torch.Tensor:
    """(B,) per-sequence weights, or (B, T) when some sequence carries per-token weights."""
    w = torch.tensor([s.weight for s in seqs], dtype=torch.float32)
    if all(s.token_weights is None for s in seqs):
        return w
    tok = torch.ones((len(seqs), T))
    for i, s in enumerate(seqs):
        if s.token_weights is not None:
            tok[i, : len(s.token_weights)] = torch.tensor(s.token_weights)
    return w.unsqueeze(-1) * tok


def micro_batch_slices(
    rows: int,
    per_device_train_batch_size: int | None,
    gradient_accumulation_steps: int,
    multiple: int = 1,
) -> list[slice]:
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
    return replace(
        c,
        input_ids=c.input_ids[rows, first:],
        attention_mask=attention[:, first:],
        position_ids=c.position_ids[rows, first:],
        completion_ids=c.completion_ids[rows],
        lengths=c.lengths[rows],
        columns=c.columns.rows(rows) if c.columns is not None else None,
    )
