"""Batch API, cache, prompt encoding, errors, residual aggregation and serialisation."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from mutualrl.retokenize import AlignmentResiduals, Retokenizer, aggregate_residuals

from .helpers import source_ids

TEXTS = ["First completion. 1 + 1 = 2", "Второй ответ 😀", "", "def g():\n    return 3\n"]


def test_batch_matches_single(retokenizers, handles):
    rt = retokenizers["mistral-v1"]
    ids = [source_ids(retokenizers, "deepseek-v3", t) for t in TEXTS]
    lps = [-np.arange(1, i.size + 1) / 10 for i in ids]
    eos = [True, False, True, False]
    batch = rt.retokenize_batch(
        TEXTS, source=handles["deepseek-v3"], source_ids=ids, source_logprobs=lps, ends_with_eos=eos
    )
    for k, text in enumerate(TEXTS):
        one = rt.retokenize(
            text,
            source=handles["deepseek-v3"],
            source_ids=ids[k],
            source_logprobs=lps[k],
            ends_with_eos=eos[k],
        )
        assert np.array_equal(one.target_ids, batch[k].target_ids)
        assert np.array_equal(one.group_logprob_sums, batch[k].group_logprob_sums)
        assert one.residuals == batch[k].residuals


def test_cache_is_bounded_and_keyed_by_fingerprint(handles):
    rt = Retokenizer(handles["deepseek-v3"], cache_size=2)
    rt.retokenize("alpha", source=handles["mistral-v1"])
    rt.retokenize("alpha", source=handles["mistral-v1"])
    assert rt.cache.hits == 2  # target and source encodings of the same text
    for text in ("b", "c", "d"):
        rt.encode_completion(text)
    assert len(rt.cache) == 2
    off = Retokenizer(handles["deepseek-v3"], cache_size=0)
    off.encode_completion("x")
    assert len(off.cache) == 0
    # Returned ids are the caller's to modify; the cached arrays are not.
    ids = rt.encode_completion("d")
    ids[0] = -1
    assert rt.encode_completion("d")[0] != -1


def test_encode_prompt_uses_receiver_format(retokenizers):
    ids = retokenizers["mistral-v1"].encode_prompt("Solve 2 + 2.")
    assert ids[0] == retokenizers["mistral-v1"].target.tokenizer.bos_token_id
    with pytest.raises(ValueError, match="prompt: .*no chat template"):
        retokenizers["mistral-v1"].encode_prompt([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"source_ids": [1, 2, 3], "source_logprobs": [-1.0]}, r"source_logprobs\[0\]: expected 3"),
        (
            {"source_ids": [1, 2, 3], "source_logprobs": [-1.0, float("nan"), -0.5]},
            r"source_logprobs\[0\]: log-prob at position 1 is nan",
        ),
        ({"source_logprobs": [float("nan")]}, r"source_logprobs\[0\]: .*position 0 is nan"),
        ({"source_ids": [1, 2], "source_logprobs": [float("inf"), -1.0]}, r"position 0 is inf"),
        ({"source_ids": [10**9]}, r"source_ids\[0\]: expected ids in \[0, "),
        ({"source_ids": [[1, 2]]}, r"source_ids\[0\]: expected a 1-D sequence"),
    ],
)
def test_errors_name_the_field(retokenizers, handles, kwargs, match):
    with pytest.raises(ValueError, match=match):
        retokenizers["deepseek-v3"].retokenize("abc", source=handles["mistral-v1"], **kwargs)


def test_nan_logprob_in_a_batch_names_the_text_and_position(retokenizers, handles):
    with pytest.raises(ValueError, match=r"source_logprobs\[1\]: log-prob at position 0 is nan"):
        retokenizers["deepseek-v3"].retokenize_batch(
            ["ab", "cd"],
            source=handles["mistral-v1"],
            source_ids=[[1], [2]],
            source_logprobs=[[-1.0], [float("nan")]],
        )


def test_batch_errors_name_the_offending_text(retokenizers, handles):
    """The whole-batch id and log-prob checks trace a failure back to its text and position."""
    rt = retokenizers["deepseek-v3"]
    with pytest.raises(
        ValueError,
        match=r"source_ids\[2\]: expected ids in \[0, .*got range "
        r"\[-1, 5\]",
    ):
        rt.retokenize_batch(
            ["a", "", "c"], source=handles["mistral-v1"], source_ids=[[1], [], [5, -1]]
        )
    with pytest.raises(
        ValueError,
        match=r"source_logprobs\[2\]: log-prob at position 1 is inf;"
        r".*\(2 such",
    ):
        rt.retokenize_batch(
            ["a", "", "cd"],
            source=handles["mistral-v1"],
            source_ids=[[1], [], [2, 3, 4]],
            source_logprobs=[[-1.0], [], [-1.0, float("inf"), float("nan")]],
        )


def test_ids_and_logprobs_of_any_integer_and_float_type_give_the_same_batch(retokenizers, handles):
    """int64 ids and float64 log-probs as arrays (what a run hands over) pass their checks in
    one test per text; lists, other dtypes and mixed batches take the per-text conversion: the
    same results, and the same errors naming the text."""
    rt = retokenizers["mistral-v1"]
    texts = TEXTS[:2] + TEXTS[3:]
    ids = [source_ids(retokenizers, "deepseek-v3", t) for t in texts]
    lps = [-np.linspace(0.1, 1.0, i.size) for i in ids]
    want = rt.retokenize_batch(
        texts, source=handles["deepseek-v3"], source_ids=ids, source_logprobs=lps
    )
    for as_ids, as_lps in (
        (lambda a: a.tolist(), lambda a: a.tolist()),
        (lambda a: a.astype(np.int32), lambda a: a.astype(np.float32)),
        (lambda a: a.astype(np.uint32), lambda a: a),
    ):
        mixed = [as_ids(ids[0]), *ids[1:]]
        for got_ids in ([as_ids(i) for i in ids], mixed):
            got = rt.retokenize_batch(
                texts,
                source=handles["deepseek-v3"],
                source_ids=got_ids,
                source_logprobs=[as_lps(lp) for lp in lps],
            )
            for a, b in zip(got, want):
                assert np.array_equal(a.target_ids, b.target_ids)
                assert np.allclose(a.group_logprob_sums, b.group_logprob_sums, atol=1e-6)
                assert a.residuals.n_groups == b.residuals.n_groups
    bad = [ids[0], ids[1].reshape(1, -1), ids[2]]
    with pytest.raises(ValueError, match=r"source_ids\[1\]: expected a 1-D sequence"):
        rt.retokenize_batch(texts, source=handles["deepseek-v3"], source_ids=bad)
    short = [lps[0], lps[1][:-1], lps[2]]
    with pytest.raises(ValueError, match=r"source_logprobs\[1\]: expected"):
        rt.retokenize_batch(
            texts, source=handles["deepseek-v3"], source_ids=ids, source_logprobs=short
        )


def test_batch_target_ids_are_the_callers(handles):
    """A batch hands out slices of one fresh array: writing into one result changes neither the
    other results nor the cached encodings."""
    rt = Retokenizer(handles["mistral-v1"])
    texts = ["one two", "three four", "one two"]
    ids = [
        rt.profile_for(handles["deepseek-v3"]).continuation.encode(t, add_special_tokens=False).ids
        for t in texts
    ]
    first = rt.retokenize_batch(texts, source=handles["deepseek-v3"], source_ids=ids)
    want = [r.target_ids.copy() for r in first]
    first[0].target_ids[:] = -1
    assert np.array_equal(first[1].target_ids, want[1])
    assert np.array_equal(first[2].target_ids, want[2])
    again = rt.retokenize_batch(texts, source=handles["deepseek-v3"], source_ids=ids)
    for r, w in zip(again, want):
        assert np.array_equal(r.target_ids, w)


def test_errors_for_bad_text_and_settings(retokenizers, handles):
    with pytest.raises(ValueError, match=r"texts\[0\]: expected valid Unicode"):
        retokenizers["deepseek-v3"].retokenize("bad \ud800", source=handles["mistral-v1"])
    with pytest.raises(ValueError, match=r"texts\[2\]: expected valid Unicode"):
        retokenizers["deepseek-v3"].retokenize_batch(["ok", "fine", "bad \ud800"])
    with pytest.raises(TypeError, match=r"texts\[1\]: expected str, got bytes"):
        retokenizers["deepseek-v3"].retokenize_batch(["ok", b"bytes"])
    with pytest.raises(ValueError, match="source: expected the sender"):
        retokenizers["deepseek-v3"].retokenize("abc", source_ids=[1])
    with pytest.raises(ValueError, match="max_length"):
        Retokenizer(handles["deepseek-v3"], max_length=0)
    with pytest.raises(ValueError, match="ends_with_eos: expected one entry"):
        retokenizers["deepseek-v3"].retokenize_batch(["a"], ends_with_eos=[True, False])


def test_without_source_only_target_side(retokenizers):
    out = retokenizers["deepseek-v3"].retokenize("no sender", ends_with_eos=True)
    assert out.group_logprob_sums is None and out.residuals.specials_added == 1


def test_residuals_serialise_and_aggregate(retokenizers, handles):
    outs = retokenizers["bert-wordpiece"].retokenize_batch(TEXTS, source=handles["mistral-v1"])
    res = [o.residuals for o in outs]
    wire = msgspec.msgpack.encode(res[0])
    assert msgspec.msgpack.decode(wire, type=AlignmentResiduals) == res[0]
    agg = aggregate_residuals(res)
    assert agg["count"] == 4.0
    assert 0.0 <= agg["boundary_iou_mean"] <= 1.0
    assert agg["frac_groups_1_1"] + agg["frac_groups_1_n"] + agg["frac_groups_n_1"] + agg[
        "frac_groups_n_m"
    ] == pytest.approx(1.0)
    assert all(isinstance(v, float) for v in agg.values())
    assert aggregate_residuals([]) == {"count": 0.0}


def test_group_index_views(retokenizers, handles):
    text = "group ids 漢字"
    ids = source_ids(retokenizers, "mistral-v1", text)
    out = retokenizers["deepseek-v3"].retokenize(text, source=handles["mistral-v1"], source_ids=ids)
    tgi = out.target_group_index()
    assert tgi.size == out.target_ids.size and (np.diff(tgi) >= 0).all() and tgi.min() == 0
    sgi = out.groups.source_group_index(ids.size)
    assert sgi[-1] == tgi[-1] == len(out.groups) - 1


@pytest.mark.parametrize(
    "pair",
    [
        ("bert-wordpiece", "mistral-v1"),
        ("mistral-v1", "bert-wordpiece"),
        ("deepseek-v3", "bert-wordpiece"),
        ("bert-wordpiece", "deepseek-v3"),
    ],
)
def test_batch_matches_single_on_the_benchmark_corpus(handles, pair):
    """The batched path (one encode/decode/normalise per side) equals text-by-text calls."""
    from mutualrl.bench.retokenize import load_corpus

    texts = load_corpus()[::4]
    src, tgt = pair
    rt = Retokenizer(handles[tgt], cache_size=0, max_length=64)
    sprof = rt.profile_for(handles[src])
    ids = [np.array(sprof.continuation.encode(t, add_special_tokens=False).ids) for t in texts]
    ids = [np.append(i, sprof.eos_id) if k % 3 == 0 else i for k, i in enumerate(ids)]
    lps = [-np.linspace(0.1, 2.0, i.size) for i in ids]
    eos = [k % 2 == 0 for k in range(len(texts))]
    batch = rt.retokenize_batch(
        texts, source=handles[src], source_ids=ids, source_logprobs=lps, ends_with_eos=eos
    )
    for k, text in enumerate(texts):
        one = rt.retokenize(
            text,
            source=handles[src],
            source_ids=ids[k],
            source_logprobs=lps[k],
            ends_with_eos=eos[k],
        )
        assert np.array_equal(one.target_ids, batch[k].target_ids)
        for a, b in zip(one.groups.columns(), batch[k].groups.columns()):
            assert np.array_equal(a, b)
        assert np.array_equal(one.group_logprob_sums, batch[k].group_logprob_sums)
        assert one.residuals == batch[k].residuals


def test_batched_normaliser_check_matches_per_text(retokenizers):
    from mutualrl.retokenize.normalize import _SEP, normalizer_changes

    prof = retokenizers["bert-wordpiece"].profile
    texts = [
        "already lower",
        "Mixed Case",
        "café",
        "\u0301leading mark",
        "tab\there",
        "中文",
        "",
        "ΣΑΣ",
        "ok",
        f"has the separator {_SEP} inside",
    ]
    norm = prof.continuation.normalizer
    want = [norm.normalize_str(t) != t for t in texts]
    assert normalizer_changes(prof, texts) == want
    assert normalizer_changes(prof, texts[:-1]) == want[:-1]


@pytest.mark.parametrize(
    "pair",
    [
        ("deepseek-v3", "mistral-v1"),
        ("mistral-v1", "bert-wordpiece"),
        ("bert-wordpiece", "deepseek-v3"),
    ],
)
@pytest.mark.parametrize("variant", ["logprobs", "no_logprobs", "encoded_source"])
def test_vectorised_batch_residuals_match_single_on_the_corpus(handles, pair, variant):
    """The whole-batch segment reductions (texts without specials, EOS group or truncation) give
    the same groups, sums and residuals, bit for bit and type for type, as one text at a time."""
    from mutualrl.bench.retokenize import load_corpus

    texts = load_corpus()[::3] + ["", " ", "x"]
    src, tgt = pair
    rt = Retokenizer(handles[tgt], cache_size=0)
    sprof = rt.profile_for(handles[src])
    ids = [
        np.array(sprof.continuation.encode(t, add_special_tokens=False).ids, dtype=np.int64)
        for t in texts
    ]
    if sprof.eos_id is not None:  # a few texts keep the per-text path: a special in the middle
        ids = [
            np.insert(i, i.size // 2, sprof.eos_id) if k % 5 == 0 else i for k, i in enumerate(ids)
        ]
    lps = [-(np.linspace(0.1, 2.0, i.size) ** 1.5) for i in ids]
    kw = {
        "logprobs": dict(source_ids=ids, source_logprobs=lps),
        "no_logprobs": dict(source_ids=ids),
        "encoded_source": {},
    }[variant]
    batch = rt.retokenize_batch(texts, source=handles[src], **kw)
    for k, text in enumerate(texts):
        one = rt.retokenize(text, source=handles[src], **{key: v[k] for key, v in kw.items()})
        assert np.array_equal(one.target_ids, batch[k].target_ids)
        for a, b in zip(one.groups.columns(), batch[k].groups.columns()):
            assert np.array_equal(a, b) and a.dtype == b.dtype
        if one.group_logprob_sums is None:
            assert batch[k].group_logprob_sums is None
        else:
            assert one.group_logprob_sums.tobytes() == batch[k].group_logprob_sums.tobytes()
        for f in AlignmentResiduals.__struct_fields__:
            a, b = getattr(one.residuals, f), getattr(batch[k].residuals, f)
            assert type(a) is type(b) and a == b, (k, f, a, b)
