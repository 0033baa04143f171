"""Causal LM architectures a policy can have, built tiny and random or loaded from a checkpoint.

Architectures are a registry (``ARCHITECTURES``) for random initialisation only: each entry turns
a ``PolicyConfig`` plus the policy's tokenizer facts into a transformers config. The embedded
default pairs a Llama-style and a Qwen2-style model so two genuinely different families train
side by side. A checkpoint (a folder, or a packaged model's converted folder) may be of any
``model_type`` ``AutoModelForCausalLM`` builds (Gemma 3 among them): it is loaded as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from mutualrl.config import ConfigError, PolicyConfig
from mutualrl.registry import Registry

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class TokenizerFacts:
    """What a model config needs to know about its tokenizer."""

    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int
    pad_token_id: int

    @classmethod
    def of(cls, tokenizer) -> TokenizerFacts:
        return cls(
            len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
        )


def base_model(model: torch.nn.Module) -> PreTrainedModel:
    """The transformers model itself: the one a peft wrapper (LoRA) holds, or ``model``."""
    unwrap = getattr(model, "get_base_model", None)  # a peft model's
    return cast("PreTrainedModel", unwrap() if unwrap is not None else model)


ARCHITECTURES: Registry[Callable[[PolicyConfig, TokenizerFacts], object]] = Registry("architecture")


def _common(p: PolicyConfig, t: TokenizerFacts) -> dict:
    return dict(
        vocab_size=t.vocab_size,
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size or 4 * p.hidden_size,
        num_hidden_layers=p.num_layers,
        num_attention_heads=p.num_heads,
        num_key_value_heads=p.num_heads,
        max_position_embeddings=512,
        # Tied input/output embeddings: with 32k-129k vocabularies the embedding dominates a tiny
        # model, and tying halves both its memory and its optimizer state.
        tie_word_embeddings=True,
        bos_token_id=t.bos_token_id,
        eos_token_id=t.eos_token_id,
        pad_token_id=t.pad_token_id,
    )


@ARCHITECTURES.register("llama")
def _llama(p: PolicyConfig, t: TokenizerFacts):
    from transformers import LlamaConfig

    return LlamaConfig(**_common(p, t))


@ARCHITECTURES.register("qwen2")
def _qwen2(p: PolicyConfig, t: TokenizerFacts):
    from transformers import Qwen2Config

    return Qwen2Config(**_common(p, t))


@ARCHITECTURES.register("gemma3")
def _gemma3(p: PolicyConfig, t: TokenizerFacts):
    """Gemma 3's text model: five sliding-window layers (window 512) to one global layer, as in
    the released checkpoints, at the policy's sizes (head size hidden / heads, where Gemma 3's
    own config would fix it at 256)."""
    from transformers import Gemma3TextConfig

    head_dim = p.hidden_size // p.num_heads
    return Gemma3TextConfig(
        **_common(p, t), head_dim=head_dim, query_pre_attn_scalar=head_dim, sliding_window=512
    )


@ARCHITECTURES.register("mistral")
def _mistral(p: PolicyConfig, t: TokenizerFacts):
    from transformers import MistralConfig

    return MistralConfig(**_common(p, t), sliding_window=None)


def model_config(p: PolicyConfig, facts: TokenizerFacts):
    """The transformers config of the policy's model: its checkpoint's, or its architecture's."""
    if p.checkpoint:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(p.checkpoint)
    return ARCHITECTURES.get(p.architecture)(p, facts)


def build_model(p: PolicyConfig, facts: TokenizerFacts, seed: int) -> torch.nn.Module:
    """A randomly initialised model (seeded), or the checkpoint at ``p.checkpoint``."""
    from transformers import AutoModelForCausalLM

    if p.checkpoint:
        from mutualrl.policies.model_cache import verify_before_load

        # a converted packaged model is loaded only while it matches its manifest: the driver
        # checked it, but a worker loads it later (and, in its own process, from disk again)
        verify_before_load(p.checkpoint)
        loaded = AutoModelForCausalLM.from_pretrained(
            p.checkpoint,
            dtype=torch.float32,
            output_loading_info=True,
            attn_implementation=p.attn_implementation,
        )
        model, info = cast(tuple[torch.nn.Module, dict], loaded)
        if info["missing_keys"]:  # transformers would train them from a random start
            from mutualrl.policies.checkpoint_files import misfit

            field = f"policies.{p.name}.checkpoint"
            raise ConfigError(misfit(field, p.checkpoint, [], info["missing_keys"]))
        return model
    config = ARCHITECTURES.get(p.architecture)(p, facts)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, attn_implementation=p.attn_implementation)


def empty_model(p: PolicyConfig, facts: TokenizerFacts) -> torch.nn.Module:
    """The policy's model with every tensor on the meta device: its structure, no memory."""
    from transformers import AutoModelForCausalLM

    config = model_config(p, facts)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def count_parameters(p: PolicyConfig, vocab_size: int) -> int:
    """Exact parameter count without allocating weights (built on the meta device)."""
    model = empty_model(p, TokenizerFacts(vocab_size, None, 0, 0))
    return sum(t.numel() for t in model.parameters())
