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


def test_prompt_prefix_goes_before_the_question_in_either_rendering(handles):
    shots = "Question: What is 1 + 1?\nAnswer: 2\n\n"
    tok = handles["mistral-v1"].tokenizer
    raw = view(handles, prompt_prefix=shots)
    assert raw.encode_prompt("Question: What is 2 + 3?\nAnswer:") == (
        tok.bos_token_id,
        *tok(shots + "Question: What is 2 + 3?\nAnswer:", add_special_tokens=False)["input_ids"],
    )
    chat = view(handles, "deepseek-v3", chat_template=QWEN, prompt_prefix=shots)
    plain = view(handles, "deepseek-v3", chat_template=QWEN)
    # inside the user's turn, the template around it as without a prefix
    assert chat.encode_prompt("What is 2 + 3?") == plain.encode_prompt(shots + "What is 2 + 3?")
    assert chat.encode_prompt("What is 2 + 3?", " 5") == plain.encode_prompt(
        shots + "What is 2 + 3?", " 5"
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


# A template is run only in Jinja's sandbox, and only for so long: the real payloads, from a real
# tokenizer folder's tokenizer_config.json, fail in one line naming the policy and the file.
ESCAPE = "{{ ''.__class__.__mro__ }}"
# 25 million iterations: about 1 s here, so 0.1 s is past the limit, and the renderer left behind
# spinning (a Python loop cannot be stopped from outside) ends soon after, not at the session's
# end (the CLI check ran the two range(100000) loops: stopped at 10 s, exit 2)
FOREVER = "{% for i in range(5000) %}{% for j in range(5000) %}{% endfor %}{% endfor %}"


def _folder_with(template: str, tmp_path: Path) -> Path:
    import json

    folder = tmp_path / "tok"
    load_tokenizer("mistral-v1").tokenizer.save_pretrained(folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
    return folder


def _check(folder: Path, handles: dict | None = None) -> None:
    from mutualrl.policies.checkpoints import check_policies

    p = PolicyConfig(name="p", tokenizer=str(folder), chat_template=True)
    check_policies([p], handles or {str(folder): load_tokenizer(str(folder))}, checkpoints={})


def test_a_template_the_sandbox_refuses_is_one_line_naming_its_file(tmp_path):
    folder = _folder_with(ESCAPE, tmp_path)
    with pytest.raises(ConfigError) as caught:
        _check(folder)
    assert str(caught.value) == (
        f"policies.p.chat_template ({folder / 'tokenizer_config.json'}): the chat template was "
        "stopped by Jinja's sandbox (access to attribute '__class__' of 'str' object is "
        "unsafe.); templates run only sandboxed: fix it, give a template file, or false for "
        "raw text"
    )


def test_a_template_that_renders_forever_is_stopped_at_the_time_limit(tmp_path, monkeypatch):
    import time

    from mutualrl.policies import prompting

    monkeypatch.setattr(prompting, "RENDER_TIMEOUT_S", 0.1)
    folder = _folder_with(FOREVER, tmp_path)
    loaded = {str(folder): load_tokenizer(str(folder))}
    t0 = time.perf_counter()
    with pytest.raises(
        ConfigError,
        match=r"^policies.p.chat_template \(.*tokenizer_config.json\)"
        r": the chat template rendered for over 0.1 s without finishing",
    ):
        _check(folder, loaded)
    assert time.perf_counter() - t0 < 0.9
