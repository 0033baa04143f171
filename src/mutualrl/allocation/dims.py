"""Architecture dimensions a memory estimate needs, from wherever they are known.

In order: the checkpoint's ``config.json`` when it is on this machine, read through transformers'
config class (and its safetensors headers for an MLP width no field names); the
``[allocation.architectures."<policy>"]`` table (checkpoints planned for elsewhere, or what such a
config.json cannot tell); the policy's own config (tiny random models: no grouped-query
attention, MLP width ``4 h`` unless given).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mutualrl.config import AllocationConfig, ArchitectureDims, ConfigError, PolicyConfig
from mutualrl.policies.checkpoints import (
    config_file,
    largest_layer_parameters,
    read_checkpoint_config,
    text_config,
)

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


# The names transformers' config classes give a decoder layer's MLP width: Llama, GPT-NeoX, Phi
# intermediate_size; OPT ffn_dim; GPT-2, GPT-J, CodeGen n_inner; Falcon ffn_hidden_size. A class
# that declares one and leaves it None builds 4 x hidden_size (GPT-2's n_inner, GPT-Neo's
# intermediate_size: ``n_inner if n_inner is not None else 4 * hidden_size`` in their models).
MLP_WIDTH_NAMES = ("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size")
_REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")


def _int(config, name: str) -> int | None:
    # a heterogeneous config raises (not AttributeError) for a per-layer value read globally
    try:
        value = getattr(config, name, None)
    except (AttributeError, RuntimeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def dims_from_config_json(cfg: dict, where: str, folder: Path | None = None) -> Dims:
    """The dims of a checkpoint's config.json as transformers reads it (``text_config``: every
    family's names and its class's defaults). An MLP width no config field names (BLOOM's, MPT's)
    is solved from the largest decoder layer's exact parameter count in the safetensors weights in
    ``folder``: the width for which ``gathered_bytes``' layer formula gives that count."""
    file = folder / "config.json" if folder is not None else Path("config.json")
    try:
        t = text_config(cfg)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: transformers refuses {file}: {_first_line(exc)}") from None
    layers, hidden, heads, vocab = (_int(t, k) for k in _REQUIRED)
    if layers is None or hidden is None or heads is None or vocab is None:
        missing = ", ".join(k for k in _REQUIRED if _int(t, k) is None)
        raise ConfigError(f"{where}: {file} lacks the dims a memory estimate needs: {missing}")
    head_dim = _int(t, "head_dim") or hidden // heads
    # Falcon names its KV heads num_kv_heads; a multi-query model read as one KV head per query
    # head over-estimates its KV cache, never under-estimates it.
    kv_width = (_int(t, "num_key_value_heads") or _int(t, "num_kv_heads") or heads) * head_dim
    return Dims(
        layers=layers,
        hidden=hidden,
        kv_width=kv_width,
        intermediate=_mlp_width(t, hidden, kv_width, folder, f"{where}: {file}"),
        vocab=vocab,
    )


def _mlp_width(t, hidden: int, kv_width: int, folder: Path | None, where: str) -> int:
    named = [w for k in MLP_WIDTH_NAMES if (w := _int(t, k))]
    if named:
        return named[0]
    if any(k in vars(t) for k in MLP_WIDTH_NAMES):
        return 4 * hidden  # declared and left None: see MLP_WIDTH_NAMES
    layer = largest_layer_parameters(folder) if folder is not None else None
    if layer is None:
        raise ConfigError(
            f"{where} names no MLP width ({', '.join(MLP_WIDTH_NAMES)}) and no safetensors "
            "weights beside it give a layer's parameter count to derive it from"
        )
    # gathered_bytes' layer: 2h(h + kv) attention + 3 h i MLP + 2h norms
    return max(1, (layer - 2 * hidden * (hidden + kv_width) - 2 * hidden) // (3 * hidden))


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
    found = config_file(p.checkpoint) if p.checkpoint else None
    if found is not None:
        try:
            return dims_from_config_json(
                json.loads(found.read_text()), f"policies.{p.name}.checkpoint", found.parent
            )
        except ConfigError:
            if p.name not in alloc.architectures:
                raise  # else the table stands in for what config.json cannot tell
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
    if cfg is not None:  # the class's default where the file is silent (GPT-2's: tied)
        return bool(getattr(text_config(cfg), "tie_word_embeddings", False))
    if p.name in alloc.architectures:
        return alloc.architectures[p.name].tie_word_embeddings
    return not p.checkpoint  # policies.models ties a random model's embeddings
