"""A group's prompt computed once: the rows of a collated batch that share their prompt ids run
the prompt's forward pass once, and their completions attend to its keys and values.

GRPO samples ``num_generations`` completions per prompt, and a collated batch repeats the
prompt in every row of its group: with 50-token chat prompts and 2-16-token completions most of
an update's positions are copies (Prefix Grouper, arXiv 2506.05433, makes the same
observation). ``shared_forward`` computes the distinct prompts once with a KV cache, selects the
cache's rows for the whole batch (``index_select``: differentiable, so each completion's gradient
flows back into the one prompt pass it came from), then runs the completions alone over that
cache. Plain transformers calls on an unmodified model (any family whose cache is transformers'
``DynamicCache``, sliding-window layers included): the keys, positions and masks each completion
position sees are those of the unshared pass, so log-probs, loss and gradients equal it within
float rounding (tests/policies/test_shared_prefix.py).

Rows are grouped by their whole prompt as collated (ids and padding), so peer rows under another
rendering of the same problem stay apart: sharing happens only where prompts are equal.

``prefill`` is the sampler's side: the prompts of ``num_generations`` completions each are
prefilled once per distinct prompt, and the cache (a dynamic one's rows selected, or a static
one written in place for every row) and the last position's logits are the batch's.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers import DynamicCache


def cache_keyword(model) -> str:
    """The name of ``model``'s KV cache, as its forward's keyword and its output's field.

    transformers 5.24 renamed ``past_key_values`` to ``cache`` (both; the old names warn and are
    to be removed in 5.40), while the versions our extras allow go back to 4.56 (vLLM's CPU build
    pins < 5.20), where only ``past_key_values`` exists. Read once from the forward's signature
    (a PEFT wrapper's forward takes ``**kwargs``: its base model's is the one that names it).
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


@dataclass(frozen=True)
class PrefixGroups:
    """Which rows share a prompt: ``first`` (G,) the row each distinct prompt is computed from,
    ``inverse`` (B,) the distinct prompt of each row."""

    first: torch.Tensor
    inverse: torch.Tensor

    @property
    def count(self) -> int:
        return int(self.first.shape[0])


def prefix_groups(input_ids: torch.Tensor, attention: torch.Tensor, P: int) -> PrefixGroups | None:
    """The rows of a (B, P+T) collated batch whose first ``P`` positions (the left-padded prompt:
    ids and mask) are equal; None when no two rows share one (nothing to gain)."""
    if input_ids.shape[0] < 2 or P < 1:
        return None
    key = torch.cat([input_ids[:, :P], attention[:, :P]], 1)
    distinct, inverse = torch.unique(key, dim=0, return_inverse=True)
    G = distinct.shape[0]
    if G == key.shape[0]:
        return None
    # the first row of each distinct prompt: the smallest row index mapped to it
    rows = torch.arange(key.shape[0])
    first = torch.full((G,), key.shape[0], dtype=torch.long).scatter_reduce(
        0, inverse, rows, reduce="amin"
    )
    return PrefixGroups(first=first, inverse=inverse)


def distinct_pass(model, ids, attention, positions, groups: PrefixGroups, **kw):
    """``model``'s cached forward over the distinct rows of (B, P) prompts, and the (B,) index of
    each row's among them (on the inputs' device)."""
    first, inverse = groups.first.to(ids.device), groups.inverse.to(ids.device)
    out = model(
        input_ids=ids[first],
        attention_mask=attention[first],
        position_ids=positions[first],
        use_cache=True,
        **kw,
    )
    return out, inverse


def shared_forward(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention: torch.Tensor,
    positions: torch.Tensor,
    T: int,
    groups: PrefixGroups,
    head: bool,
) -> torch.Tensor:
    """What the unshared pass gives at the T positions predicting the completion tokens
    (L-T-1 .. L-2 of a (B, L) batch): logits (B, T, V) when ``head`` (``model`` a causal LM),
    else the final hidden states (B, T, H) (``model`` its decoder). Inputs on the model's device.

    Two passes: the G distinct prompts (positions 0 .. P-1, P = L-T) with a cache, whose last
    position predicts the first completion token; then every row's completion positions
    P .. L-2 over the cache's rows selected for it."""
    P = input_ids.shape[1] - T
    key = cache_keyword(model)
    kept = {"logits_to_keep": 1} if head else {}
    out, inverse = distinct_pass(
        model, input_ids[:, :P], attention[:, :P], positions[:, :P], groups, **kept
    )
    lead = (out.logits if head else out.last_hidden_state[:, -1:]).index_select(0, inverse)
    if T == 1:
        return lead
    cache = getattr(out, key)
    cache.reorder_cache(inverse)  # (G, ...) -> (B, ...) per layer, by index_select
    out = model(
        input_ids=input_ids[:, P : P + T - 1],
        attention_mask=attention[:, : P + T - 1],
        position_ids=positions[:, P : P + T - 1],
        use_cache=True,
        **{key: cache},
    )
    tail = out.logits if head else out.last_hidden_state
    return torch.cat([lead, tail], 1)


def prefill(
    model: torch.nn.Module,
    ids: torch.Tensor,
    attention: torch.Tensor,
    positions: torch.Tensor,
    static=None,
    share: bool = True,
):
    """The prompt pass of a (B, P) batch of left-padded prompts, once per distinct prompt: the
    (B, V) logits at its last position and the cache the decode steps continue, the model's own
    dynamic cache or ``static`` (a transformers ``StaticCache`` for B rows, empty; its tensors
    are written in place, so a compiled decode step keeps their addresses). ``share`` False:
    every row computes its prompt (what benchmarks compare with)."""
    key, P = cache_keyword(model), ids.shape[1]
    groups = prefix_groups(ids, attention, P) if share else None
    if groups is None:
        kw = (
            {}
            if static is None
            else {key: static, "cache_position": torch.arange(P, device=ids.device)}
        )
        out = model(
            input_ids=ids,
            attention_mask=attention,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **kw,
        )
        return out.logits[:, -1], getattr(out, key)
    # a static target takes every prompt position of every layer: a cache without a config keeps
    # them all (sliding-window layers of a config's cache keep only their window)
    kw = {} if static is None else {key: DynamicCache()}
    out, inverse = distinct_pass(model, ids, attention, positions, groups, logits_to_keep=1, **kw)
    logits, cache = out.logits[:, -1].index_select(0, inverse), getattr(out, key)
    if static is None:
        cache.reorder_cache(inverse)
        return logits, cache
    where = {"cache_position": torch.arange(P, device=ids.device)}
    for i, layer in enumerate(cache.layers):
        static.update(layer.keys[inverse], layer.values[inverse], i, where)
    return logits, static
