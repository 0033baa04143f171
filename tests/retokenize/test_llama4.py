"""The packaged Llama 4 tokenizer (``llama-4``, from the ``llama-models`` wheel): ids, special
tokens and chat format as Meta's reference tokenizer gives them, and THL against Llama 3."""

from __future__ import annotations

import numpy as np
import pytest

from mutualrl.retokenize import Retokenizer, load_tokenizer

from .helpers import check_tiling, group_text_equal
from .test_llama3 import ALL_TEXTS

pytest.importorskip("llama_models", reason="pip install llama-models (extra 'llama')")


@pytest.fixture(scope="module")
def llama4():
    return load_tokenizer("llama-4")


@pytest.fixture(scope="module")
def reference():
    from llama_models.llama4.tokenizer import Tokenizer

    return Tokenizer.get_instance()


@pytest.fixture(scope="module")
def rts(llama4):
    profiles: dict = {}  # byte tables shared by both directions
    return {h.name: Retokenizer(h, profiles=profiles) for h in (llama4, load_tokenizer("llama-3"))}


def test_ids_and_specials_match_meta_reference(llama4, reference):
    tok = llama4.tokenizer
    assert llama4.vocab_size == 202_048 == reference.n_words and llama4.family == "bpe"
    assert tok("The quick brown fox", add_special_tokens=False)["input_ids"] == [
        954,
        7202,
        27756,
        92637,
    ]
    for name, text in ALL_TEXTS.items():
        ids = tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        assert ids == reference.encode(text, bos=False, eos=False), name
        assert tok.decode(ids) == text, name
    added = tok.backend_tokenizer.get_added_tokens_decoder()
    assert {t.content: i for i, t in added.items()} == reference.special_tokens
    assert all(t.special for t in added.values())


def test_bos_eos_pad_and_chat_format(llama4, reference, rts):
    tok = llama4.tokenizer
    assert (
        (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
        == (reference.bos_id, reference.eot_id, reference.pad_id)
        == (200000, 200008, 200018)
    )
    assert tok("Hi")["input_ids"][0] == 200000
    assert tok("Hi", add_special_tokens=False)["input_ids"][0] != 200000
    msgs = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "2+2?"}]
    sp = reference.special_tokens

    def enc(s):
        return reference.encode(s, bos=False, eos=False)

    want = [sp["<|begin_of_text|>"]]
    for role, content in [(m["role"], m["content"]) for m in msgs] + [("assistant", None)]:
        want += [sp["<|header_start|>"], *enc(role), sp["<|header_end|>"], *enc("\n\n")]
        if content is not None:
            want += [*enc(content), sp["<|eot|>"]]
    assert rts["llama-4"].encode_prompt(msgs).tolist() == want


@pytest.mark.parametrize(("src", "tgt"), [("llama-4", "llama-3"), ("llama-3", "llama-4")])
def test_thl_round_trips_with_llama3(rts, src, tgt):
    assert rts[src].profile.lossless and rts[tgt].profile.lossless
    for name, text in ALL_TEXTS.items():
        ids = rts[src].encode_completion(text)
        lps = -np.linspace(0.1, 2.0, ids.size)
        out = rts[tgt].retokenize(text, source=rts[src].target, source_ids=ids, source_logprobs=lps)
        check_tiling(out, ids.size, len(text.encode()), eos_group=False)
        group_text_equal(rts[src], rts[tgt], out, ids, text.encode())
        assert out.group_logprob_sums.sum() == pytest.approx(lps.sum(), abs=1e-9)
        r = out.residuals
        assert not (r.roundtrip_mismatch or r.source_mismatch), name
        assert rts[tgt].target.tokenizer.decode(out.target_ids) == text, name
