"""Meta's Llama 3 and Llama 4 tokenizers: what a fast tokenizer needs besides the vocabulary.

The vocabularies (tiktoken BPE files) and the pre-tokenizer regexes come from Meta's
``llama-models`` wheel (``llama_models/llama3`` and ``llama_models/llama4``); ``loaders`` converts
them with transformers' ``TikTokenConverter``. This module holds the rest, as Meta's Instruct
releases define it:

* ``llama-3``: the 256 special ids from 128000 with the names of Meta's Llama 3 release
  (``meta-llama/Meta-Llama-3-8B-Instruct``): ``<|begin_of_text|>`` 128000, ``<|end_of_text|>``
  128001, ``<|start_header_id|>`` 128006, ``<|end_header_id|>`` 128007, ``<|eot_id|>`` 128009 and
  ``<|reserved_special_token_0|>`` ... ``_250|>`` on the other ids in order. Llama 3.1+ (and
  ``llama_models/llama3/tokenizer.py``) later named some reserved ids (128004
  ``<|finetune_right_pad_id|>``, 128008 ``<|eom_id|>``, 128010 ``<|python_tag|>``, ...); the
  vocabulary, the ids and every encoding of text are the same.
  BOS ``<|begin_of_text|>`` (prepended when special tokens are added), EOS ``<|eot_id|>`` as in
  the Instruct ``tokenizer_config.json`` (a chat turn ends there; base models stop at
  ``<|end_of_text|>``, which stays a special token), no pad token (``load_tokenizer`` pads with
  EOS), and Llama 3 Instruct's chat template.
* ``llama-4``: the 2048 special ids from 200000, named by Meta's reference tokenizer in the
  package (``llama_models.llama4.tokenizer``); BOS ``<|begin_of_text|>``, EOS ``<|eot|>``, pad
  ``<|finetune_right_pad|>``, and Llama 4's chat format for text messages (no tool or image
  branches), rendered as Meta's reference ``ChatFormat`` encodes a dialog.
"""

from __future__ import annotations

from itertools import count

LLAMA3_NUM_SPECIALS = 256
# The named Llama 3 specials by offset from 128000; every other offset is a reserved token.
_LLAMA3_NAMED = {
    0: "<|begin_of_text|>",
    1: "<|end_of_text|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    9: "<|eot_id|>",
}

LLAMA3_BOS = "<|begin_of_text|>"
LLAMA3_EOS = "<|eot_id|>"
LLAMA4_BOS = "<|begin_of_text|>"
LLAMA4_EOS = "<|eot|>"
LLAMA4_PAD = "<|finetune_right_pad|>"

# Llama 3 Instruct's template: BOS, then per message a role header, the trimmed content and
# <|eot_id|>; the generation prompt opens an assistant header.
LLAMA3_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{- message['content'] | trim }}"
    "{{- '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)

# Llama 4's text chat format: the same shape with <|header_start|>/<|header_end|> and <|eot|>;
# the content is kept as given (Meta's reference ChatFormat does not trim it).
LLAMA4_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|header_start|>' + message['role'] + '<|header_end|>\\n\\n' }}"
    "{{- message['content'] }}"
    "{{- '<|eot|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|header_start|>assistant<|header_end|>\\n\\n' }}"
    "{%- endif %}"
)


def llama3_specials() -> list[str]:
    """The 256 Llama 3 special tokens in id order (from 128000)."""
    reserved = (f"<|reserved_special_token_{i}|>" for i in count())
    return [_LLAMA3_NAMED.get(k) or next(reserved) for k in range(LLAMA3_NUM_SPECIALS)]


def reference_tokenizer_class(version: int):
    """Meta's tiktoken-based ``Tokenizer`` class for Llama ``version`` (3 or 4) in llama-models."""
    if version == 3:
        from llama_models.llama3.tokenizer import Tokenizer
    else:
        from llama_models.llama4.tokenizer import Tokenizer
    return Tokenizer


def pattern(version: int) -> str:
    """The pre-tokenizer regex of Meta's reference tokenizer (Llama 3: cl100k-style, numbers in
    runs of up to three digits; Llama 4: o200k-style)."""
    cls = reference_tokenizer_class(version)
    return cls.pat_str if version == 3 else cls.O200K_PATTERN


def llama4_specials(model_file) -> list[str]:
    """The 2048 Llama 4 special tokens in id order, as Meta's reference tokenizer names them
    (it reads the vocabulary file to number them, so this takes about a second)."""
    ref = reference_tokenizer_class(4)(model_file)
    return sorted(ref.special_tokens, key=ref.special_tokens.__getitem__)
