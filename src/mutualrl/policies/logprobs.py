"""How a policy's model scores completions: logits at the completion positions, per-token
log-probs (differentiable with their entropy, for the loss; or without gradient, micro-batch by
micro-batch) and per-sequence totals.

``LogProbs`` holds the settings that decide them (device, pad id, the sampling distribution,
LM-head chunking, micro-batch sizes, precision) and no model: each call is given the model to
run, be it the learner's, its KL reference, a sampler's frozen copy or rank 0's whole copy of a
sharded learner. The learner, the update's ``Objective``, the generation backends and the
mismatch correction all take their log-probs from one of these.

A micro-batch with more completion positions than ``training.logprob_chunk_size`` takes its
log-probs from the final hidden states through ``grpo.chunked_token_logprobs``, so no (rows, T, V)
logits exist. Precision: ``bf16`` runs forward passes under ``torch.autocast`` (bf16) over fp32
weights; a sharded model casts itself (FSDP2's mixed precision) and runs without it.

With ``shared_prefix`` (``training.shared_prefix`` where it is exact) rows that share their
prompt compute it once (``policies.prefix``): the same log-probs, for a fraction of the positions.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from mutualrl.config import GRPOConfig, TrainingConfig
from mutualrl.grpo import (
    chunked_token_logprobs,
    completion_mask,
    sampled_entropy,
    selective_log_softmax,
    token_logprobs,
)
from mutualrl.policies.batch import Collated, collate, micro_batch_slices, take_rows
from mutualrl.policies.models import base_model
from mutualrl.policies.prefix import PrefixGroups, prefix_groups, shared_forward
from mutualrl.policies.sampling import truncate_logits, truncates


@dataclass
class LogProbs:
    """A policy's log-prob functions, given the model to run at each call."""

    name: str  # the policy's (errors name it)
    device: torch.device  # where the model's inputs go
    pad_id: int
    grpo: GRPOConfig  # the sampling distribution: temperature, top_k, top_p
    training: TrainingConfig  # logprob_chunk_size, entropy_sample_size, micro-batches
    bf16: bool  # forward passes under bf16 autocast
    # rows sharing their prompt compute it once (policies.prefix); off where a pass must not
    # change shape per micro-batch (sharded ranks) or keeps no cache (gradient checkpointing)
    shared_prefix: bool = False

    def autocast(self):
        """The policy's compute precision for a forward pass (backward follows it)."""
        if not self.bf16:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def completion_logits(
        self, model: torch.nn.Module, c: Collated, temperature: float | None = None
    ) -> torch.Tensor:
        """Logits predicting each completion token: (B, T, V), computed only at those positions.

        Divided by ``temperature`` (default: the sampling temperature, so log-probs are those of
        the distribution the samples came from; SFT passes 1)."""
        L, T = c.input_ids.shape[1], c.completion_len
        # The logits at positions L-T-1 .. L-2 predict the T completion tokens. Asking the model
        # for exactly those (not the last T+1, then slicing) spares a (B, T+1, V) copy forward
        # and a zero-filled one in backward: with a 129k vocabulary these passes cost as much
        # as the LM head itself.
        ids, attention, positions = self._inputs(c)
        if (groups := self._groups(c)) is not None:
            base = base_model(model)
            if (head := plain_head(base)) is not None:
                # the LM head once over the (B, T, H) hidden states, as the unshared pass runs
                # it: no (B, T, V) logits are selected per row and concatenated (with a 262k
                # vocabulary those copies cost more than the prompt passes saved)
                hidden = shared_forward(
                    base.get_decoder(), ids, attention, positions, T, groups, head=False
                )
                logits = head(hidden)
            else:  # a head the model's forward adapts (soft-capping, scaling): its own call
                logits = shared_forward(model, ids, attention, positions, T, groups, head=True)
        else:
            keep = torch.arange(L - T - 1, L - 1, device=ids.device)
            logits = model(
                input_ids=ids,
                attention_mask=attention,
                position_ids=positions,
                logits_to_keep=keep,
            ).logits
        logits = logits.float()
        g = self.grpo
        if temperature is None and truncates(g.top_k, g.top_p):
            # the sampling distribution is truncated: take log-probs under the same truncation
            return truncate_logits(
                logits.div_(g.temperature), g.top_k, g.top_p, keep=c.completion_ids.to(self.device)
            )
        temperature = temperature or g.temperature
        # In place: the LM head's backward needs its input and weight, not its output.
        return logits.div_(temperature) if temperature != 1 else logits

    def token_logprobs(
        self,
        model: torch.nn.Module,
        c: Collated,
        temperature: float | None = None,
        entropy: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Differentiable (B, T) log-probs of the completion tokens, and (B, T) entropy (no grad;
        None when not asked for and not free)."""
        with self.autocast():
            if (chunk := self._chunk_size(c)) is not None:
                t = temperature or self.grpo.temperature
                return self._hidden_logprobs(model, c, t, chunk)
            # temperature None: the sampling distribution, top_k/top_p truncation included
            logits = self.completion_logits(model, c, temperature=temperature)
            logp, logp_all = token_logprobs(logits, c.completion_ids.to(self.device))
        if not entropy:
            return logp, None
        valid = completion_mask(c.completion_ids, c.lengths).to(logp_all.device)
        return logp, sampled_entropy(logp_all, valid, self.training.entropy_sample_size)

    @torch.no_grad()
    def plain_logprobs(self, model: torch.nn.Module, c: Collated) -> torch.Tensor:
        """(B, T) log-probs, not differentiated (behaviour, reference, off-policy ratios)."""
        with self.autocast():
            if (chunk := self._chunk_size(c)) is not None:
                return self._hidden_logprobs(model, c, self.grpo.temperature, chunk)[0]
            logits = self.completion_logits(model, c)
            return selective_log_softmax(logits, c.completion_ids.to(self.device))

    @torch.no_grad()
    def batch_logprobs(self, model: torch.nn.Module, c: Collated) -> torch.Tensor:
        """(B, T) log-probs of a whole collated batch, computed micro-batch by micro-batch."""
        slices = self._slices(c.input_ids.shape[0])
        if len(slices) == 1:
            return self.plain_logprobs(model, c)
        return torch.cat([self.plain_logprobs(model, take_rows(c, s)) for s in slices])

    @torch.no_grad()
    def sequence_logprobs(
        self,
        model: torch.nn.Module,
        prompts: list[tuple[int, ...]],
        completions: list[tuple[int, ...]],
    ) -> torch.Tensor:
        """Total log-prob of each completion: (B,), micro-batch by micro-batch."""
        c = collate(prompts, completions, self.pad_id)
        mask = completion_mask(c.completion_ids, c.lengths)
        slices = self._slices(len(prompts))
        if len(slices) == 1:
            return (self.plain_logprobs(model, c).cpu() * mask).sum(-1)
        return torch.cat(
            [(self.plain_logprobs(model, take_rows(c, s)).cpu() * mask[s]).sum(-1) for s in slices]
        )

    def _slices(self, rows: int) -> list[slice]:
        """Micro-batches of a pass without gradient: every rank runs all of them."""
        t = self.training
        return micro_batch_slices(
            rows, t.per_device_train_batch_size, t.gradient_accumulation_steps
        )

    def _inputs(self, c: Collated) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dev = self.device
        return c.input_ids.to(dev), c.attention_mask.to(dev), c.position_ids.to(dev)

    def _groups(self, c: Collated) -> PrefixGroups | None:
        """The rows of ``c`` that share their prompt, when it is shared and some do."""
        if not self.shared_prefix:
            return None
        P = c.input_ids.shape[1] - c.completion_len
        return prefix_groups(c.input_ids, c.attention_mask, P)

    def _chunk_size(self, c: Collated) -> int | None:
        """``training.logprob_chunk_size`` when ``c`` has more completion positions (its LM head
        runs in chunks of it); None: it runs whole."""
        size = self.training.logprob_chunk_size
        return size if size is not None and c.input_ids.shape[0] * c.completion_len > size else None

    def _hidden_logprobs(
        self, model: torch.nn.Module, c: Collated, temperature: float, chunk_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T) log-probs and entropy from final hidden states, the LM head in chunks of
        ``chunk_size`` positions."""
        base = base_model(model)
        head = plain_head(base)
        if head is None:
            raise ValueError(
                f"training.logprob_chunk_size: policy {self.name!r} has an LM head "
                f"({type(base.get_output_embeddings()).__name__}) that is not a plain linear "
                "layer; unset logprob_chunk_size for it"
            )
        L, T = c.input_ids.shape[1], c.completion_len
        ids, attention, positions = self._inputs(c)
        decoder = base.get_decoder()
        if (groups := self._groups(c)) is not None:
            hidden = shared_forward(decoder, ids, attention, positions, T, groups, head=False)
        else:
            out = decoder(
                input_ids=ids, attention_mask=attention, position_ids=positions, use_cache=False
            )
            hidden = out.last_hidden_state[:, L - T - 1 : L - 1]  # (B, T, H)
        return chunked_token_logprobs(
            hidden,
            head.weight,
            head.bias,
            c.completion_ids.to(self.device),
            temperature,
            chunk_size,
        )


# config fields by which a causal LM's forward adapts its head's output (Gemma 2's soft-capping,
# Cohere's and Granite's scaling): such a head is only exact through the model's own forward
HEAD_ADAPTERS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def plain_head(base) -> torch.nn.Linear | None:
    """``base``'s LM head when the logits are that linear layer of the final hidden states and
    nothing more; None otherwise."""
    head = base.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        return None
    if any(getattr(base.config, name, None) not in (None, 1, 1.0) for name in HEAD_ADAPTERS):
        return None
    return head
