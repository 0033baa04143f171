"""Chat templates: each policy renders a question in its own family's format, opt-in."""

from __future__ import annotations

from pathlib import Path

import pytest

from mutualrl.config import ConfigError, PolicyConfig
from mutualrl.policies.policy import PolicyView
from mutualrl.retokenize.loaders import load_tokenizer

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"
QWEN = str(TEMPLATES / "qwen2.5-instruct.jinja")
LLAMA = str(TEMPLATES / "llama-3.2-instruct.jinja")


@pytest.fixture(scope="module")
def handles():
    return {n: load_tokenizer(n) for n in ("deepseek-v3", "mistral-v1")}


def view(handles, tokenizer="mistral-v1", **kw) -> PolicyView:
    return PolicyView(PolicyConfig(name="p", tokenizer=tokenizer, **kw), handles[tokenizer])


def test_two_families_render_the_same_question_in_their_own_format(handles):
    qwen = view(handles, "deepseek-v3", chat_template=QWEN)
    llama = view(handles, "mistral-v1", chat_template=LLAMA, system_prompt="Answer briefly.")
    assert qwen.chat.render("What is 2 + 3?") == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
        "<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert llama.chat.render("What is 2 + 3?") == (
        "<s><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
        "Today Date: 26 Jul 2024\n\nAnswer briefly.<|eot_id|><|start_header_id|>user"
        "<|end_header_id|>\n\nWhat is 2 + 3?<|eot_id|><|start_header_id|>assistant"
        "<|end_header_id|>\n\n"
    )
    ids = llama.encode_prompt("What is 2 + 3?")
    # the template writes the BOS itself: exactly one, first
    assert ids[0] == handles["mistral-v1"].tokenizer.bos_token_id
    assert ids.count(handles["mistral-v1"].tokenizer.bos_token_id) == 1
    assert (
        handles["mistral-v1"].tokenizer.decode(ids[1:]).endswith("assistant<|end_header_id|>\n\n")
    )
    assert qwen.encode_prompt("What is 2 + 3?") == qwen.encode_prompt("What is 2 + 3?")


def test_default_is_raw_text_bit_for_bit(handles):
    v = view(handles)
    assert v.chat is None
    tok = handles["mistral-v1"].tokenizer
    assert v.encode_prompt("first: a b =") == (
        tok.bos_token_id,
        *tok("first: a b =", add_special_tokens=False)["input_ids"],
    )


def test_tokenizer_without_template_fails_naming_the_field(handles):
    with pytest.raises(
        ConfigError,
        match=r"policies.p.chat_template: tokenizer 'mistral-v1' has "
        r"no chat template",
    ):
        view(handles, chat_template=True)
    with pytest.raises(ConfigError, match="policies.p.chat_template: template file not found"):
        view(handles, chat_template="/no/such.jinja")


def test_tokenizer_own_template_is_used_when_true(handles):
    tok = load_tokenizer("mistral-v1").tokenizer
    tok.chat_template = Path(QWEN).read_text()
    v = PolicyView(
        PolicyConfig(name="p", chat_template=True),
        type(handles["mistral-v1"])(
            name="x", family="sentencepiece", tokenizer=tok, fingerprint="x"
        ),
    )
    assert v.chat.render("hi").endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_system_prompt_needs_a_template():
    with pytest.raises(Exception, match="system_prompt needs chat_template"):
        import msgspec

        msgspec.convert({"name": "p", "system_prompt": "x"}, PolicyConfig)
