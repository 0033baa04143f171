"""``mutualrl.bench.results.write_run``: one JSON per benchmark, one run per subject in it."""

from __future__ import annotations

import json

from mutualrl.bench.results import write_run


def test_a_run_replaces_only_its_own_label_in_a_file_of_runs(tmp_path):
    path = tmp_path / "floor.json"
    path.write_text(
        json.dumps(
            {
                "note": "kept",
                "runs": [
                    {"label": "mistral-v1", "x": 1},
                    {"label": "gemma-3-270m", "x": 2},
                ],
            }
        )
    )
    write_run(path, {"label": "mistral-v1", "x": 3})
    got = json.loads(path.read_text())
    assert got["note"] == "kept"
    assert [(r.get("label"), r["x"]) for r in got["runs"]] == [
        ("gemma-3-270m", 2),
        ("mistral-v1", 3),
    ]


def test_a_single_run_file_is_written_whole(tmp_path):
    path = tmp_path / "sub" / "generation.json"
    write_run(path, {"label": "smoke", "x": 1})
    write_run(path, {"label": "other", "x": 2})
    assert json.loads(path.read_text()) == {"label": "other", "x": 2}


def test_bench_retokenize_writes_its_pairs_run_into_the_results_file(tmp_path):
    """``mutualrl bench retokenize --output`` into a file of runs replaces the run of its own
    ``--pairs`` and keeps the others, as ``benchmarks/results/retokenize.json`` holds them."""
    from mutualrl.bench import retokenize_cli

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    texts = ["The answer is 42.", "Zwölf Äpfel kosten 3,50 €."]
    (corpus / "a.jsonl").write_text("".join(json.dumps({"completion": t}) + "\n" for t in texts))
    out = tmp_path / "retokenize.json"
    out.write_text(json.dumps({"runs": [{"label": "default", "x": 1}]}))
    pairs = "mistral-v1:deepseek-v3"
    argv = ["--pairs", pairs, "--corpus", str(corpus), "--repeats", "1", "--no-peers"]
    assert retokenize_cli.main([*argv, "--output", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["label"] for r in runs] == ["default", pairs]
    assert [(p["source"], p["target"]) for p in runs[1]["pairs"]] == [("mistral-v1", "deepseek-v3")]
