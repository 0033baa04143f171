"""Architecture dimensions a memory estimate needs, from wherever they are known.

In order: the checkpoint's ``config.json`` when it is on this machine; the
``[allocation.architectures."<policy>"]`` table (checkpoints planned for elsewhere); the policy's
own config (tiny random models: no grouped-query attention, MLP width ``4 h`` unless given).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mutualrl.config import AllocationConfig, ArchitectureDims, ConfigError, PolicyConfig
from mutualrl.policies.checkpoints import read_checkpoint_config

DIM_KEYS = (
    "num_hidden_layers, hidden_size, num_attention_heads, num_key_value_heads, intermediate_size, "
    "vocab_size"
)


@dataclass(frozen=True)
class Dims:
    layers: int
    hidden: int
    kv_width: int  # num_key_value_heads x head_dim: the width of K (and of V) per token
    intermediate: int
    vocab: int


def dims_from_hint(d: ArchitectureDims) -> Dims:
    head_dim = d.head_dim or d.hidden_size // d.num_attention_heads
    return Dims(
        layers=d.num_hidden_layers,
        hidden=d.hidden_size,
        kv_width=(d.num_key_value_heads or d.num_attention_heads) * head_dim,
        intermediate=d.intermediate_size or 4 * d.hidden_size,
        vocab=d.vocab_size,
    )


def dims_from_config_json(cfg: dict, where: str) -> Dims:
    try:
        hint = ArchitectureDims(
            **{k: cfg[k] for k in ArchitectureDims.__struct_fields__ if cfg.get(k) is not None}
        )
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"{where}: config.json lacks the dims a memory estimate needs ({DIM_KEYS}): {exc}"
        ) from None
    return dims_from_hint(hint)


def dims_from_policy(p: PolicyConfig, vocab: int) -> Dims:
    return Dims(
        layers=p.num_layers,
        hidden=p.hidden_size,
        kv_width=p.hidden_size,
        intermediate=p.intermediate_size or 4 * p.hidden_size,
        vocab=vocab,
    )


def resolve_dims(
    p: PolicyConfig, alloc: AllocationConfig, vocab_size: Callable[[str], int]
) -> Dims:
    """The policy's dims; a checkpoint not on this machine needs its table in ``[allocation]``."""
    cfg = read_checkpoint_config(p)
    if cfg is not None:
        return dims_from_config_json(cfg, f"policies.{p.name}.checkpoint")
    if p.name in alloc.architectures:
        return dims_from_hint(alloc.architectures[p.name])
    if p.checkpoint:
        raise ConfigError(
            f"allocation.architectures.{p.name}: checkpoint {p.checkpoint!r} is not on "
            f"this machine; give its config.json dims ({DIM_KEYS}) there"
        )
    return dims_from_policy(p, vocab_size(p.tokenizer))


def tied_embeddings(p: PolicyConfig, alloc: AllocationConfig) -> bool:
    """Whether the policy's input and output embeddings are one matrix: config.json's
    ``tie_word_embeddings``, else the table's, else (a random model here) yes."""
    cfg = read_checkpoint_config(p)
    if cfg is not None:
        return bool(cfg.get("tie_word_embeddings", False))
    if p.name in alloc.architectures:
        return alloc.architectures[p.name].tie_word_embeddings
    return not p.checkpoint  # policies.models ties a random model's embeddings
