"""Hand-written cases: scripts, whitespace, code, specials by role, truncation, source mismatch."""

from __future__ import annotations

import numpy as np
import pytest

from .helpers import PAIRS, check_tiling, group_text_equal, source_ids

CASES = {
    "emoji": "Great job 😀👍🏽 and a flag 🇫🇷 and a family 👨‍👩‍👧!",
    "cjk": "日本語のテキストと中文文本，还有한국어 문장。",
    "arabic": "مرحبا بالعالم، العدد ١٢٣ هنا.",
    "combining": "Cafe\u0301 naïve re\u0301sume\u0301 Ångström",
    "whitespace": "a  b   c\n\n\nd\t\te \u00a0f\u3000g   \n",
    "leading_space": "  leading and trailing spaces  ",
    "code": "def f(x):\n    return {'a': x**2, \"b\": [1, 2, 3]}  # comment\n\tpass\n",
    "math": "Step 1: 12 * 7 = 84.\nStep 2: 84 / 4 = 21.\n#### 21",
    "literal_specials": "the model wrote </s> and <s> and [SEP] and <｜end▁of▁sentence｜> as text",
    "empty": "",
    "only_space": "   \n\t ",
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(("src", "tgt"), PAIRS, ids=[f"{s}->{t}" for s, t in PAIRS])
def test_hand_cases(retokenizers, handles, src, tgt, case):
    text = CASES[case]
    ids = source_ids(retokenizers, src, text)
    lps = -np.linspace(0.1, 2.0, ids.size)
    out = retokenizers[tgt].retokenize(
        text, source=handles[src], source_ids=ids, source_logprobs=lps
    )
    check_tiling(out, ids.size, len(text.encode()), eos_group=False)
    group_text_equal(retokenizers[src], retokenizers[tgt], out, ids, text.encode())
    assert out.group_logprob_sums.sum() == pytest.approx(lps.sum(), abs=1e-9)
    r = out.residuals
    if retokenizers[tgt].profile.lossless and "\u2581" not in text:
        assert not r.roundtrip_mismatch, "lossless receivers reproduce the text byte for byte"
    # A special token's *text* is literal content, never the receiver's special id.
    assert not retokenizers[tgt].profile.special[out.target_ids].any()


def test_emoji_split_inside_a_character_stays_in_one_group(retokenizers, handles):
    # DeepSeek spells "😀" as two byte-level tokens that split its 4 UTF-8 bytes.
    text = "ok 😀"
    ids = source_ids(retokenizers, "deepseek-v3", text)
    out = retokenizers["bert-wordpiece"].retokenize(
        text, source=handles["deepseek-v3"], source_ids=ids
    )
    g = out.groups
    last = len(g) - 1
    assert (g.byte_start[last], g.byte_end[last]) == (2, len(text.encode()))
    assert g.src_end[last] - g.src_start[last] >= 2  # both halves of the emoji, one group


def test_no_spurious_prefix_space_for_sentencepiece(retokenizers, handles):
    rt = retokenizers["mistral-v1"]
    assert rt.profile.text_bytes(rt.encode_completion("Hello").tolist()) == b"Hello"
    out = rt.retokenize(" Hello", source=handles["deepseek-v3"])
    assert out.residuals.groups_1_1 == out.residuals.n_groups == 1
    assert rt.profile.text_bytes(out.target_ids.tolist()) == b" Hello"


def test_sentencepiece_literal_metaspace_is_a_roundtrip_residual(retokenizers, handles):
    text = "a\u2581b c"  # '▁' typed as text: SentencePiece renders it as a space
    out = retokenizers["mistral-v1"].retokenize(text, source=handles["deepseek-v3"])
    assert out.residuals.roundtrip_mismatch and out.residuals.roundtrip_edit_distance == 3
    check_tiling(out, out.residuals.n_source_tokens, len(text.encode()), eos_group=False)


def test_wordpiece_normaliser_residual(retokenizers, handles):
    out = retokenizers["bert-wordpiece"].retokenize("Café OK", source=handles["mistral-v1"])
    r = out.residuals
    assert r.normalizer_changed_text and r.roundtrip_mismatch and r.roundtrip_edit_distance > 0
    assert out.groups.byte_end[-1] == len("Café OK".encode())


def test_whitespace_only_text_against_wordpiece_is_one_group(retokenizers, handles):
    out = retokenizers["bert-wordpiece"].retokenize(" \n ", source=handles["deepseek-v3"])
    assert out.target_ids.size == 0
    assert len(out.groups) == 1 and out.groups.byte_end[0] == 3
    assert out.residuals.groups_n_m == 1


def test_specials_by_role(retokenizers, handles):
    src, rt = retokenizers["mistral-v1"].profile, retokenizers["deepseek-v3"]
    body = source_ids(retokenizers, "mistral-v1", "The answer is 42.")
    ids = np.concatenate([[1], body, [2]])  # <s> ... </s>
    lps = np.concatenate([[-9.0], np.full(body.size, -0.5), [-0.25]])
    out = rt.retokenize(
        "The answer is 42.",
        source=handles["mistral-v1"],
        source_ids=ids,
        source_logprobs=lps,
        ends_with_eos=True,
    )
    g, r = out.groups, out.residuals
    assert out.target_ids[-1] == rt.profile.eos_id and src.eos_id == 2
    assert g.src_start[0] == 1, "BOS is stripped, not aligned"
    assert (g.src_start[-1], g.src_end[-1], g.byte_start[-1], g.byte_end[-1]) == (
        ids.size - 1,
        ids.size,
        len(b"The answer is 42."),
        len(b"The answer is 42."),
    )
    assert out.group_logprob_sums[-1] == -0.25
    assert r.eos_paired and r.specials_stripped == 1 and r.specials_added == 0
    assert r.logprob_mass_unassigned == pytest.approx(9.0)
    assert out.group_logprob_sums.sum() + -9.0 == pytest.approx(lps.sum())


def test_eos_added_without_source_eos_is_a_residual(retokenizers, handles):
    ids = source_ids(retokenizers, "deepseek-v3", "done")
    out = retokenizers["bert-wordpiece"].retokenize(
        "done", source=handles["deepseek-v3"], source_ids=ids, ends_with_eos=True
    )
    assert out.target_ids[-1] == retokenizers["bert-wordpiece"].profile.eos_id  # [SEP] by role
    assert out.residuals.specials_added == 1 and not out.residuals.eos_paired
    check_tiling(out, ids.size, 4, eos_group=True)


def test_truncation_cuts_on_a_group_boundary(handles):
    from mutualrl.retokenize import Retokenizer

    text = "one two three four five six seven eight nine ten " * 3
    rt = Retokenizer(handles["mistral-v1"], max_length=10)
    src = Retokenizer(handles["deepseek-v3"]).encode_completion(text)
    lps = np.full(src.size, -1.0)
    out = rt.retokenize(
        text, source=handles["deepseek-v3"], source_ids=src, source_logprobs=lps, ends_with_eos=True
    )
    r = out.residuals
    assert out.target_ids.size <= 10 and out.target_ids.size == out.groups.tgt_end[-1]
    assert r.truncated_tokens == r.n_target_tokens + 1 - out.target_ids.size > 0
    assert r.truncated_bytes == len(text) - out.groups.byte_end[-1]
    assert out.group_logprob_sums.size == len(out.groups)
    # Unassigned mass is reported as a magnitude; these log-probs are all negative.
    assert out.group_logprob_sums.sum() - r.logprob_mass_unassigned == pytest.approx(lps.sum())


def test_source_ids_cut_inside_a_character(retokenizers, handles):
    # A length-capped generation can stop mid-character; its decode ends in U+FFFD.
    ids = source_ids(retokenizers, "deepseek-v3", "ab 😀")[:-1]
    text = retokenizers["deepseek-v3"].profile.text_bytes(ids.tolist()).decode(errors="replace")
    out = retokenizers["mistral-v1"].retokenize(text, source=handles["deepseek-v3"], source_ids=ids)
    assert out.residuals.source_mismatch and out.residuals.source_edit_distance > 0
    check_tiling(out, ids.size, len(text.encode()), eos_group=False)


def test_text_only_source_is_encoded_with_the_source(retokenizers, handles):
    text = "Mixed text: 漢字 and code `x += 1`"
    a = retokenizers["deepseek-v3"].retokenize(text, source=handles["mistral-v1"])
    b = retokenizers["deepseek-v3"].retokenize(
        text, source=handles["mistral-v1"], source_ids=source_ids(retokenizers, "mistral-v1", text)
    )
    assert np.array_equal(a.target_ids, b.target_ids)
    assert np.array_equal(a.groups.src_end, b.groups.src_end)
