"""Per-prompt held-out results: written at every evaluation, consistent with the per-family
means in metrics.jsonl; and runs under the non-default scenarios go through."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mutualrl.config import load_config
from mutualrl.run import train
from mutualrl.run.evaluation import read_heldout
from mutualrl.run.metrics import read_metrics

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.toml"
pytestmark = pytest.mark.usefixtures("fast_run_builds")


@pytest.mark.parametrize("scenario", ["overlap", "asymmetric"])
def test_heldout_jsonl_matches_the_eval_records_under_each_scenario(tmp_path, scenario):
    train(
        load_config(
            TINY,
            [
                f'output_dir="{tmp_path}"',
                "steps=1",
                "eval.num_prompts=6",
                "eval.k=3",
                f'scenario="{scenario}"',
            ],
        )
    )
    records = read_metrics(tmp_path / "metrics.jsonl")
    done = [r for r in records if r["phase"] == "warmup_done"]
    assert {r["policy"] for r in done} == {"llama-mistral", "qwen-deepseek"}
    per_prompt = read_heldout(tmp_path)
    evals = [r for r in records if r["phase"] == "eval"]
    assert [(r["step"], r["policy"]) for r in per_prompt] == [
        (0, "llama-mistral"),
        (0, "qwen-deepseek"),
        (1, "llama-mistral"),
        (1, "qwen-deepseek"),
    ]
    for r in per_prompt:
        assert r["k"] == 3 and len(r["prompt_ids"]) == len(r["greedy"]) == len(r["sampled"]) == 12
        assert r["prompt_ids"] == per_prompt[0]["prompt_ids"]  # same prompts, same order
        assert all(0 <= c <= 3 for c in r["sampled"]) and len(r["greedy_text"]) == 12
        record = next(e for e in evals if e["step"] == r["step"])
        fams = np.array(r["families"])
        for f in set(r["families"]):
            greedy = float(np.array(r["greedy"])[fams == f].mean())
            assert record[f"policy/{r['policy']}/heldout/{f}/pass@1"] == greedy


def test_each_distinct_problem_is_evaluated_once_and_a_small_family_is_capped_with_a_note(
    tmp_path, capsys
):
    """mul at one digit has 81 problems, 20 held out: num_prompts = 64 evaluates those 20 once
    each (not 64 draws of 20), says so in one line and in plan.json; other families get 64."""
    from mutualrl.run.evaluation import eval_notes, eval_prompts
    from mutualrl.tasks import build_task

    cfg = load_config(
        TINY,
        [
            f'output_dir="{tmp_path}"',
            'task.name="arithmetic"',
            'task.families=["add", "mul"]',
            "task.digits={mul=1}",
            "eval.num_prompts=64",
        ],
    )
    task = build_task(cfg.task)
    chosen = eval_prompts(task, cfg)
    assert {f: len(ps) for f, ps in chosen.items()} == {"add": 64, "mul": 20}
    for ps in chosen.values():
        assert len({p.id for p in ps}) == len(ps)
    assert {p.text for p in chosen["mul"]} == {p.text for p in task.heldout["mul"]}
    (note,) = eval_notes(task, cfg)
    assert "'mul' has 20 distinct heldout problems" in note and "num_prompts = 64" in note
    assert eval_prompts(task, cfg) == chosen  # every evaluation of the run: the same problems


def test_a_file_tasks_heldout_pool_is_evaluated_without_repeats(tmp_path):
    """A file's held-out pool is drawn with replacement: the evaluation still takes distinct
    problems, all of them when the pool is smaller than num_prompts."""
    import json

    from mutualrl.run.evaluation import eval_prompts
    from mutualrl.tasks import build_task

    data = tmp_path / "d.jsonl"
    rows = [{"question": f"q{i}", "answer": f"#### {i}", "split": "heldout"} for i in range(12)]
    rows += [{"question": f"t{i}", "answer": f"#### {i}", "split": "train"} for i in range(5)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for n, want in ((8, 8), (30, 12)):
        cfg = load_config(
            TINY,
            [
                'task.name="jsonl"',
                f'task.path="{data}"',
                "task.families=[]",
                f"eval.num_prompts={n}",
            ],
        )
        (ps,) = eval_prompts(build_task(cfg.task), cfg).values()
        assert len(ps) == want == len({p.id for p in ps})


def test_eval_split_validation_evaluates_the_validation_set_and_records_it(tmp_path):
    train(
        load_config(
            TINY,
            [
                f'output_dir="{tmp_path}"',
                "steps=1",
                'task.name="arithmetic"',
                'task.families=["add"]',
                "warmup.max_steps=0",
                'policies.0.warmup_families=["add"]',
                'policies.1.warmup_families=["add"]',
                "eval.num_prompts=4",
                "eval.k=1",
                'eval.split="validation"',
            ],
        )
    )
    from mutualrl.config import TaskConfig
    from mutualrl.tasks import build_task

    valid = {
        p.id for p in build_task(TaskConfig(name="arithmetic", families=["add"])).validation["add"]
    }
    records = read_heldout(tmp_path)
    assert records and all(r["split"] == "validation" for r in records)
    assert all(set(r["prompt_ids"]) <= valid for r in records)


def test_a_task_without_a_validation_split_refuses_it_in_one_line(tmp_path):
    from mutualrl.config import TaskConfig
    from mutualrl.tasks import TaskError, build_task

    task = build_task(TaskConfig(name="lookup"))
    with pytest.raises(TaskError, match=r"^the lookup task has no validation split"):
        task.sample(np.random.default_rng(0), 2, "validation")
