"""The retokenization benchmark's measurement plumbing, on a few texts (timings not judged)."""

from __future__ import annotations

import json

from mutualrl.provenance import time_paired
from mutualrl.retokenize.benchmark import run_benchmark


def test_time_paired_alternates_the_contenders():
    calls = []
    a, b = time_paired(lambda: calls.append("a"), lambda: calls.append("b"), 3)
    assert calls == ["a", "b"] * 4          # one warm-up of each, then A B A B A B
    assert len(a) == len(b) == 3 and all(t >= 0 for t in a + b)


def test_benchmark_reports_paired_goal_ratios(handles, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    texts = ["The answer is 42.", "Второй ответ 😀", "def f(x):\n    return x + 1\n"]
    (corpus / "a.jsonl").write_text("".join(json.dumps({"completion": t}) + "\n" for t in texts))
    out = run_benchmark([("deepseek-v3", "mistral-v1")], corpus=corpus, repeats=2, naive_texts=0,
                        peers=False, handles=dict(handles))
    (pair,) = out["pairs"]
    paired = pair["paired"]["end_to_end_batch_over_encode_batch"]
    assert paired["pairs"] == 2 and paired["min"] <= paired["median"] <= paired["max"]
    assert paired["min"] > 0
    assert "align_speedup_vs_trl" not in pair["paired"]     # peers off: no TRL contender
    assert set(pair["end_to_end_batch_parts_over_encode_batch"]) == {
        "target_side", "source_side", "align_and_assemble"}
    assert pair["residuals"]["logprob_mass_error_max"] < 1e-9
