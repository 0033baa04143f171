"""The compare's analysis end to end on hand-made runs: per-prompt results in, starting point,
paired verdicts, sample efficiency and the trade-off table out (report.md and report.json)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import numpy as np

from mutualrl.compare import compare, parse_strategies, scenario_overrides
from mutualrl.config import to_dict
from mutualrl.report.analysis import starting_point_line
from mutualrl.run import RunSummary
from mutualrl.run.evaluation import append_heldout
from mutualrl.run.metrics import MetricsWriter

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.toml")
SETS = ["steps=4", "eval.every=2", "eval.k=4"]
PROMPTS = 40


def _heldout(cfg, step: int, policy: str, gain: float) -> dict:
    """Per-prompt results: every prompt of family 'first' right; 'last' right for a share that
    grows with the step by ``gain`` per step (the same prompts for every run of a seed)."""
    rng = np.random.default_rng([cfg.seed, 9])
    difficulty = rng.permutation((np.arange(PROMPTS // 2) + 0.5) / (PROMPTS // 2))  # evenly spread
    last = (difficulty < min(1.0, 0.1 + gain * step)).astype(int)
    fams = ["first"] * (PROMPTS // 2) + ["last"] * (PROMPTS // 2)
    greedy = [1] * (PROMPTS // 2) + last.tolist()
    return {
        "step": step,
        "policy": policy,
        "k": 4,
        "prompt_ids": [f"p{i}" for i in range(PROMPTS)],
        "families": fams,
        "greedy": greedy,
        "sampled": [3 * g for g in greedy],
        "greedy_text": [" yes" if g else " no" for g in greedy],
    }


def fake_train(cfg, progress) -> RunSummary:
    """What `train` writes, where `sgt` learns the peer family ('last') fast and `none` does not;
    `xgrpo` behaves exactly like `none`."""
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(to_dict(cfg)))
    gain = 0.2 if cfg.strategy == "sgt" else 0.0
    names = [p.name for p in cfg.policies]
    writer = MetricsWriter(out / "metrics.jsonl")
    for step in range(cfg.steps):
        rec = {"phase": "train", "step": step, "exchange/bytes": 100 * (step + 1)}
        for n in names:
            rec.update(
                {
                    f"policy/{n}/reward/mean": 0.5 + gain * step,
                    f"policy/{n}/entropy": 1.0,
                    f"policy/{n}/completion_length": 2.0,
                    f"policy/{n}/kl": 0.0,
                }
            )
            if gain:  # the strategy's own importance-weight variance, and extra sampling
                rec[f"policy/{n}/{cfg.strategy}/density_ratio_var"] = 0.25
                rec[f"policy/{n}/strategy/generated_tokens"] = 5.0
        writer.write(rec)
    final = {}
    for step in range(0, cfg.steps + 1, cfg.eval.every):
        append_heldout(out, [_heldout(cfg, step, n, gain) for n in names])
        final = {
            f"policy/{n}/heldout/pass@1": float(np.mean(_heldout(cfg, step, n, gain)["greedy"]))
            for n in names
        }
        writer.write({"phase": "eval", "step": step, **final})
    writer.close()
    summary = RunSummary(
        str(out), {n: 0.0 for n in names}, {n: 0.5 for n in names}, final, 1.0, {"train": 1.0}
    )
    (out / "summary.json").write_bytes(msgspec.json.encode(summary))
    return summary


def test_the_report_tells_a_known_difference_from_none(tmp_path):
    out = tmp_path / "c"
    compare(TINY, ["none", "xgrpo", "sgt"], 3, out, overrides=SETS, train_fn=fake_train)
    data = json.loads((out / "report.json").read_text())["analysis"]
    verdicts = {
        (r["strategy"], r["metric"]): r
        for r in data["significance"]
        if r["policy"] == "llama-mistral"
    }
    # llama-mistral's own family is 'first', its peer family 'last' (tiny.toml's warm start).
    peer = verdicts[("sgt", "pass@1 end (peer)")]
    assert (
        peer["verdict"] == "better"
        and peer["lo"] > 0
        and (peer["n_seeds"], peer["n_prompts"]) == (3, 20)
    )
    assert verdicts[("sgt", "pass@1 end (own)")]["verdict"] == "no difference at 95%"
    assert {r["verdict"] for (s, _), r in verdicts.items() if s == "xgrpo"} == {
        "no difference at 95%"
    }
    eff = {(r["policy"], r["strategy"]): r for r in data["efficiency"]}
    # step 2: two steps of 2 prompts x 4 samples x 2 tokens, plus 5 tokens of extra sampling each
    assert eff[("llama-mistral", "sgt")]["tokens_to_target"] == [(2 * 4 * 2 + 5) * 2] * 3
    assert eff[("llama-mistral", "none")]["tokens_to_target"] == [None] * 3
    assert np.mean(eff[("llama-mistral", "sgt")]["area"]) > np.mean(
        eff[("llama-mistral", "none")]["area"]
    )
    trade = {(r["policy"], r["strategy"]): r["values"] for r in data["tradeoff"]}
    assert trade[("llama-mistral", "none")]["rescued"] == [0.0] * 3
    assert min(trade[("llama-mistral", "sgt")]["rescued"]) > 0
    assert trade[("llama-mistral", "none")]["kl_to_start"] == [None] * 3  # beta = 0
    start = {(r["policy"], r["family"]): r for r in data["starting_point"]}
    assert start[("llama-mistral", "first")]["greedy"] == [1.0] * 3
    assert start[("llama-mistral", "first")]["sampled"] == [0.75] * 3
    md = (out / "report.md").read_text()
    for heading in (
        "## Starting point (scenario `disjoint`)",
        "## Paired differences against `none`",
        "## Sample efficiency",
        "## Trade-off",
    ):
        assert heading in md
    assert "**better**" in md and "| IS-weight var |" in md and "0.250 ± 0.000" in md
    glance = md.split("## At a glance", 1)[1].split("\n## ", 1)[0]
    rows = {
        line.split(" | ")[1]: line
        for line in glance.splitlines()
        if line.startswith("| llama-mistral")
    }
    assert set(rows) == {"`xgrpo`", "`sgt`"}
    assert rows["`sgt`"].split(" | ")[3].endswith("**better**")  # peer pass@1 end
    assert rows["`xgrpo`"].count("no difference") == 4
    assert rows["`xgrpo`"].endswith("| 1.00× | 1.00× |")  # same time, tokens
    assert trade[("llama-mistral", "sgt")]["is_weight_var"] == [0.25] * 3
    assert trade[("llama-mistral", "none")]["is_weight_var"] == [None] * 3
    # extra sampling counts: 5 tokens per step on top of the groups' 2.0 x prompts x generations
    own = trade[("llama-mistral", "none")]["tokens"][0]
    assert trade[("llama-mistral", "sgt")]["tokens"] == [own + 5.0 * 4] * 3  # steps=4
    assert "first 1.00/0.75" in starting_point_line(out / "runs" / "none-seed0")


def test_without_a_warm_start_the_report_speaks_of_no_warm_start_nor_own_and_peer(tmp_path):
    # pretrained policies (configs/real-cpu.toml): warmup.max_steps = 0, nothing is warm started
    out = tmp_path / "c"
    compare(
        TINY, ["none", "sgt"], 2, out, overrides=[*SETS, "warmup.max_steps=0"], train_fn=fake_train
    )
    md = (out / "report.md").read_text()
    assert "## Starting point (no warm start)" in md and "before any training" in md
    assert "scenario `disjoint`" not in md and "after the warm start" not in md
    how = md.split("## How to read this", 1)[1].split("\n## ", 1)[0]
    assert "warm start" not in how
    glance = md.split("## At a glance", 1)[1].split("\n## ", 1)[0]
    assert "peer" not in glance and "own" not in glance
    head = next(line for line in glance.splitlines() if line.startswith("| policy"))
    assert head == "| policy | strategy | Δ pass@1 end | Δ area | GRPO time | tokens |"
    row = next(line for line in glance.splitlines() if line.startswith("| llama-mistral"))
    assert row.count(" | ") == head.count(" | ")


def test_scenario_and_all_on_the_command_line():
    sets = scenario_overrides("overlap")
    assert sets[0] == 'scenario="overlap"' and "steps=30" in sets
    assert parse_strategies("all") == parse_strategies(None)


def test_the_is_weight_column_reads_the_weights_applied_before_a_raw_ratio():
    """HACPO logs both the variance of its raw ratio (before the clamp) and of the weights it
    applies; the column is the latter, as it is for PRP and CoDistill."""
    from mutualrl.report.data import is_weight_var

    class Run:
        strategy = "hacpo@1"  # a tuning compare's label; the config names the strategy
        config = {"strategy": "hacpo"}
        logged = {"hacpo/ratio_var": 0.120, "hacpo/weight_var": 0.153, "hacpo/ratio_mean": 1.0}

        def policy_keys(self, policy, prefix):
            return [k for k in self.logged if k.startswith(prefix)]

        def series(self, key, phase):
            return np.arange(2), np.full(2, self.logged[key.split("/", 2)[2]])

    assert abs(is_weight_var(Run(), "p") - 0.153) < 1e-12


def test_heldout_changes_give_each_end_its_interval_and_say_whether_it_rose(tmp_path):
    from mutualrl.report.analysis import heldout_change_lines, heldout_changes

    def rec(step, policy, greedy):
        n = len(greedy)
        return {
            "step": step,
            "policy": policy,
            "k": 1,
            "prompt_ids": [f"p{i}" for i in range(n)],
            "families": ["add"] * n,
            "greedy": greedy,
            "sampled": greedy,
            "greedy_text": ["x"] * n,
        }

    n = 100
    up = rec(0, "a", [1] * 20 + [0] * 80), rec(30, "a", [1] * 45 + [0] * 55)  # 0.20 -> 0.45
    flat = rec(0, "b", [1] * 50 + [0] * 50), rec(30, "b", [0] * 2 + [1] * 52 + [0] * 46)
    append_heldout(tmp_path, [up[0], flat[0]])
    append_heldout(tmp_path, [up[1], flat[1]])
    a, b = heldout_changes(tmp_path)
    assert a.policy == "a" and a.steps == (0, 30) and a.n_prompts == n
    assert a.start[0] == 0.2 and a.start[1] < 0.2 < a.start[2] and a.end[0] == 0.45
    assert a.change[0] == 0.25 and 0 < a.change[1] < 0.25 < a.change[2]
    assert a.verdict.startswith("rose")
    assert b.verdict.startswith("within") and abs(b.change[0] - 0.02) < 1e-12
    lines = heldout_change_lines(tmp_path)
    assert lines[0].startswith("a: 0.200 [") and "-> 0.450 [" in lines[0] and "rose" in lines[0]
    # one evaluation only: nothing to compare
    one = tmp_path / "one"
    one.mkdir()
    append_heldout(one, [up[0]])
    assert heldout_changes(one) == []


def test_the_report_names_the_split_and_counts_each_distinct_problem_once(tmp_path):
    """A run evaluated on the validation split says so at the top of the report, and a family
    whose problems repeat (half of 'last' asked twice) is counted by its distinct problems."""
    from mutualrl.run.evaluation import read_heldout

    def validation_train(cfg, progress):
        summary = fake_train(cfg, progress)
        out = Path(cfg.output_dir)
        records = read_heldout(out)
        (out / "heldout.jsonl").unlink()
        for r in records:
            half = PROMPTS // 2
            r["prompt_ids"] = r["prompt_ids"][:half] + [f"p{half + i % 10}" for i in range(half)]
            r["split"] = "validation"
        append_heldout(out, records)
        return summary

    out = tmp_path / "c"
    compare(TINY, ["none", "sgt"], 2, out, overrides=SETS, train_fn=validation_train)
    sets = {
        e["policy"]: e
        for e in json.loads((out / "report.json").read_text())["analysis"]["eval_sets"]
    }
    assert sets["llama-mistral"]["splits"] == ["validation"]
    assert sets["llama-mistral"]["families"] == {"first": 20, "last": 10}
    assert sets["llama-mistral"]["distinct_problems"] == 30
    top = (out / "report.md").read_text().split("## How to read this", 1)[0]
    assert "- llama-mistral: validation split, 30 distinct problems (first 20, last 10)" in top
    assert "**Validation split**" in top and "chooses nothing" in top


def test_a_heldout_report_carries_no_validation_label(tmp_path):
    out = tmp_path / "c"
    compare(TINY, ["none"], 1, out, overrides=SETS, train_fn=fake_train)
    top = (out / "report.md").read_text().split("## How to read this", 1)[0]
    assert "heldout split, 40 distinct problems (first 20, last 20)" in top
    assert "Validation split" not in top
