"""Loss normalisers, one per ``loss_type``, and their whole-batch form for micro-batches. Pure.

A GRPO loss reduces a (B, T) per-token loss with a normaliser that depends on the *whole* batch
(its row count, each row's token count, its total token count). It has two forms that must
agree: ``reduce`` for a batch seen at once (``aggregate``), and ``row_scales`` for a batch cut
into micro-batches. A micro-batch sees only some rows, so it cannot normalise itself; instead
the normaliser is computed once per optimizer step as a per-row scale, and every micro-batch
contributes ``sum_t loss[i, t] * mask[i, t] * scale[i]`` over its rows. Summed over
micro-batches (in any cut) this is the whole batch's ``aggregate`` up to float rounding.

Both forms of a loss_type live on one object in the ``NORMALISERS`` registry (open to plug-ins
through the ``mutualrl.loss_types`` entry point group, as strategies are), so adding a loss_type
is one entry there and the two forms cannot drift apart.

``skipped_rows`` / ``skipped_tokens``: rows a strategy left out of the batch because their
per-token loss is exactly 0 (``TrainBatch.skipped_rows``); they still count in the normaliser
(rows in B, masked completion tokens in N), so the result equals that of the full batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from mutualrl.registry import Registry, RegistryError


class LossNormaliser(Protocol):
    """One loss_type's normaliser in its two forms. ``mask`` arrives already cast (see below)."""

    def reduce(
        self,
        per_token: Tensor,
        mask: Tensor,
        max_completion_length: int,
        skipped_rows: int,
        skipped_tokens: int,
    ) -> Tensor:
        """(B, T) per-token loss, (B, T) mask in its dtype -> scalar loss of the batch."""
        ...

    def row_scales(
        self, mask: Tensor, max_completion_length: int, skipped_rows: int, skipped_tokens: int
    ) -> Tensor:
        """(B, T) fp32 mask -> (B,) fp32 factor turning row ``i``'s masked token sum into its
        share of the batch loss."""
        ...


def _has_both_forms(name: str, obj: object) -> None:
    if not (callable(getattr(obj, "reduce", None)) and callable(getattr(obj, "row_scales", None))):
        raise RegistryError(
            f"loss type {name!r} must be an object with reduce() and row_scales() (a "
            f"normalise.LossNormaliser instance), got {obj!r}"
        )


# loss_type -> its normaliser (``grpo.loss_type``; checked before a run starts).
NORMALISERS: Registry[LossNormaliser] = Registry(
    "loss type", entry_point_group="mutualrl.loss_types", check=_has_both_forms
)


@dataclass(frozen=True)
class SequenceMean:
    """``grpo``: mean over each sequence's tokens, then over sequences (the original GRPO;
    longer sequences get smaller per-token weight). Row scale 1 / (B * n_i), n_i >= 1."""

    def reduce(self, per_token, mask, max_completion_length, skipped_rows, skipped_tokens):
        per_seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # (B,)
        # mean() when nothing was skipped keeps results bit-identical to the unskipped path
        return per_seq.sum() / (per_seq.shape[0] + skipped_rows) if skipped_rows else per_seq.mean()

    def row_scales(self, mask, max_completion_length, skipped_rows, skipped_tokens):
        return 1.0 / ((mask.shape[0] + skipped_rows) * mask.sum(-1).clamp(min=1))


@dataclass(frozen=True)
class ConstantLength:
    """``dr_grpo``: sum over all tokens / (B * max_completion_length), a constant normaliser
    without length bias (not the tensor's T: the run's completion budget)."""

    def reduce(self, per_token, mask, max_completion_length, skipped_rows, skipped_tokens):
        return (per_token * mask).sum() / (
            (per_token.shape[0] + skipped_rows) * max_completion_length
        )

    def row_scales(self, mask, max_completion_length, skipped_rows, skipped_tokens):
        B = mask.shape[0]
        return mask.new_full((B,), 1.0 / ((B + skipped_rows) * max_completion_length))


@dataclass(frozen=True)
class TokenMean:
    """``dapo``: mean over all masked tokens of the batch (token level, DAPO); N >= 1."""

    def reduce(self, per_token, mask, max_completion_length, skipped_rows, skipped_tokens):
        return (per_token * mask).sum() / (mask.sum() + skipped_tokens).clamp(min=1)

    def row_scales(self, mask, max_completion_length, skipped_rows, skipped_tokens):
        return mask.new_ones(mask.shape[0]) / (mask.sum() + skipped_tokens).clamp(min=1)


NORMALISERS.register("grpo", SequenceMean())
NORMALISERS.register("dr_grpo", ConstantLength())
NORMALISERS.register("dapo", TokenMean())


def loss_normaliser(loss_type: str) -> LossNormaliser:
    """The normaliser of ``loss_type``; an unknown one fails naming the registered values."""
    try:
        return NORMALISERS.get(loss_type)
    except RegistryError as exc:
        raise ValueError(f"loss_type: {exc}") from None


def aggregate(
    per_token: Tensor,
    mask: Tensor,
    loss_type: str,
    max_completion_length: int,
    skipped_rows: int = 0,
    skipped_tokens: int = 0,
) -> Tensor:
    """Reduce a (B, T) per-token loss to a scalar with ``loss_type``'s normaliser (single pass)."""
    normaliser = loss_normaliser(loss_type)
    return normaliser.reduce(
        per_token, mask.to(per_token.dtype), max_completion_length, skipped_rows, skipped_tokens
    )


def row_scales(
    mask: Tensor,
    loss_type: str,
    max_completion_length: int,
    skipped_rows: int = 0,
    skipped_tokens: int = 0,
) -> Tensor:
    """Per-row factor turning masked token sums into the batch loss: (B, T) mask -> (B,) fp32.

    grpo: 1 / (B * n_i);  dr_grpo: 1 / (B * max_completion_length);  dapo: 1 / N.
    """
    normaliser = loss_normaliser(loss_type)
    return normaliser.row_scales(
        mask.to(torch.float32), max_completion_length, skipped_rows, skipped_tokens
    )


def scaled_sum(per_token: Tensor, mask: Tensor, scale: Tensor) -> Tensor:
    """A micro-batch's share of the batch loss: (B, T), (B, T), (B,) -> scalar."""
    mask = mask.to(per_token.dtype)
    return ((per_token * mask).sum(-1) * scale.to(per_token.dtype)).sum()


@dataclass(frozen=True)
class LossShare:
    """Where a batch's rows sit in the loss normaliser; changes per batch, not per run.

    ``row_scale`` (B,): the whole batch's ``row_scales`` for these rows when they are one
    micro-batch of it (the loss is then their share, ``scaled_sum``); None: these rows are the
    whole batch (``aggregate``). ``skipped_rows`` / ``skipped_tokens``: zero-loss rows left out,
    counted by ``aggregate`` (with ``row_scale`` they are already in it).
    """

    row_scale: Tensor | None = None  # (B,) or None
    skipped_rows: int = 0
    skipped_tokens: int = 0

    def loss(
        self, per_token: Tensor, mask: Tensor, loss_type: str, max_completion_length: int
    ) -> Tensor:
        """(B, T) per-token loss, (B, T) mask -> scalar: these rows' loss or share of it."""
        if self.row_scale is None:
            return aggregate(
                per_token,
                mask,
                loss_type,
                max_completion_length,
                self.skipped_rows,
                self.skipped_tokens,
            )
        return scaled_sum(per_token, mask, self.row_scale)


WHOLE_BATCH = LossShare()  # the rows are the whole batch, nothing skipped


def token_mean_scale(mask: Tensor) -> Tensor:
    """1 / (masked tokens of the whole batch, at least 1): the factor of a token mean
    (SFT's mean NLL, KL and clip-fraction statistics) split over micro-batches. (B, T) -> ()."""
    return 1.0 / mask.to(torch.float32).sum().clamp(min=1)
