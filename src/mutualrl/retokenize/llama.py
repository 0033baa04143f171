"""Meta's Llama 3 tokenizer: what a fast tokenizer needs besides the vocabulary.

The vocabulary (a tiktoken BPE file) and the pre-tokenizer regex come from Meta's
``llama-models`` wheel (``llama_models/llama3``); ``loaders`` converts them with transformers'
``TikTokenConverter``. This module holds the rest, as Meta's Instruct release defines it:

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
"""

from __future__ import annotations

from itertools import count

LLAMA3_NUM_SPECIALS = 256
# The named Llama 3 specials by offset from 128000; every other offset is a reserved token.
_LLAMA3_NAMED = {0: "<|begin_of_text|>", 1: "<|end_of_text|>", 6: "<|start_header_id|>",
                 7: "<|end_header_id|>", 9: "<|eot_id|>"}

LLAMA3_BOS = "<|begin_of_text|>"
LLAMA3_EOS = "<|eot_id|>"

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


def llama3_specials() -> list[str]:
    """The 256 Llama 3 special tokens in id order (from 128000)."""
    reserved = (f"<|reserved_special_token_{i}|>" for i in count())
    return [_LLAMA3_NAMED.get(k) or next(reserved) for k in range(LLAMA3_NUM_SPECIALS)]


def pattern() -> str:
    """The pre-tokenizer regex of Meta's reference tokenizer (cl100k-style: numbers in runs of up
    to three digits)."""
    from llama_models.llama3.tokenizer import Tokenizer

    return Tokenizer.pat_str
