"""The benchmark scripts still run against the code they measure: each at its smallest size, in
a subprocess as a user runs it, with the JSON it writes checked for what its tables quote.
(Their figures are taken by running them in full; see docs/results/performance.md.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str, out: Path) -> dict:
    cmd = [sys.executable, str(ROOT / "benchmarks" / script), *args]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_bench_floor_steps_both_sides_to_the_same_loss(tmp_path):
    out = tmp_path / "floor.json"
    got = _run(
        "bench_floor.py",
        "--json",
        str(out),
        "--steps",
        "2",
        "--threads",
        "1",
        "--prompts",
        "2",
        "--generations",
        "2",
        "--tokens",
        "4",
        out=out,
    )
    assert set(got["ratio_mutualrl_over_bare"]) >= {"generate", "update", "step"}
    assert got["max_abs_diff"]["loss"] < 1e-5 and got["max_abs_diff"]["grad_norm"] < 1e-5


def test_bench_lock_step_calls_times_one_config_scheduled_both_ways(tmp_path):
    """The same run's steps driven as one lock-step group and as one member per policy at
    staleness 0: both reach every segment's end, and the record holds both and their ratio."""
    out = tmp_path / "calls.json"
    got = _run(
        "bench_lock_step_calls.py",
        "--config",
        "configs/tiny.toml",
        "--segments",
        "1",
        "--segment-steps",
        "1",
        "--json",
        str(out),
        out=out,
    )
    assert set(got["s_per_step"]) == {"batched", "per-policy"}
    assert got["per_policy_over_batched"]["median"] > 0


def test_bench_floor_steps_a_checkpoint_and_keeps_the_other_runs_of_its_file(tmp_path):
    """--checkpoint: a from_pretrained folder (a tiny Llama saved here, with a real tokenizer)
    steps on both sides to the same loss; the run replaces only its own label in a file of
    several runs, as results/floor.json holds them."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from mutualrl.retokenize.loaders import load_tokenizer

    folder = tmp_path / "tiny-llama"
    hf_tok = load_tokenizer("mistral-v1").tokenizer
    hf_tok.save_pretrained(folder)
    cfg = LlamaConfig(
        vocab_size=len(hf_tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        bos_token_id=hf_tok.bos_token_id,
        eos_token_id=hf_tok.eos_token_id,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(cfg).save_pretrained(folder)
    out = tmp_path / "floor.json"
    out.write_text(json.dumps({"note": "kept", "runs": [{"label": "mistral-v1", "x": 1}]}))
    small = ["--steps", "2", "--threads", "1", "--prompts", "2", "--generations", "2"]
    got = _run(
        "bench_floor.py",
        "--json",
        str(out),
        "--checkpoint",
        str(folder),
        *small,
        "--tokens",
        "4",
        out=out,
    )
    assert got["note"] == "kept" and [r["label"] for r in got["runs"]] == [
        "mistral-v1",
        str(folder),
    ]
    run = got["runs"][1]
    assert run["command"].startswith("python benchmarks/bench_floor.py ")
    assert run["max_abs_diff"]["loss"] < 1e-5 and run["max_abs_diff"]["grad_norm"] < 1e-5


def test_bench_kv_cache_times_both_caches_on_the_same_policy(tmp_path):
    out = tmp_path / "kv.json"
    got = _run(
        "bench_kv_cache.py",
        "--models",
        "tiny",
        "--device",
        "cpu",
        "--tokens",
        "4",
        "--rounds",
        "2",
        "--prompts",
        "2",
        "--generations",
        "2",
        "--json",
        str(out),
        out=out,
    )
    tiny = got["models"]["tiny"]
    for cache in ("static", "dynamic"):
        assert len(tiny[cache]["seconds"]) == 2 and tiny[cache]["tokens"] == 16
    assert tiny["static_over_dynamic_time"] > 0


def test_bench_generation_times_eager_static_and_compiled_sampling(tmp_path):
    out = tmp_path / "generation.json"
    got = _run("bench_generation.py", "--smoke", "--threads", "1", "--json", str(out), out=out)
    assert got["command"].startswith("python benchmarks/bench_generation.py --smoke")
    assert {"eager", "static", "compiled"} <= set(got["variants"])
    for size in ("6", "8"):
        for variant in got["variants"]:
            m = got["results"][size][variant]
            assert len(m["seconds"]) == 1 and m["tokens_per_s_median"] > 0, (size, variant)
        compiled = got["results"][size]["compiled"]
        assert compiled["graphs_compiled_in_rounds"] == 0 and compiled["compile_s_in_rounds"] == 0
    first, second = got["results"]["6"]["compiled"], got["results"]["8"]["compiled"]
    assert first["compile"]["graphs"] >= 1 and first["compile"]["compile_s"] > 0
    # 8 rows fall in the bucket 6 rows were padded to: nothing compiles for them
    assert second["compile"]["graphs"] == first["compile"]["graphs"]
    assert second["compile"]["compile_s"] == 0


def test_sim_paced_drives_run_paced_with_simulated_steps(tmp_path):
    out = tmp_path / "sim.json"
    got = _run(
        "sim_paced.py",
        "--workers",
        "2",
        "--k",
        "0",
        "1",
        "--steps",
        "4",
        "--scale",
        "0.001",
        "--json",
        str(out),
        out=out,
    )
    assert {(r["workers"], r["k"]) for r in got["rows"]} == {(2, 0), (2, 1)}
    assert all(r["stale_dropped"] == 0 for r in got["rows"])


def test_bench_grpo_step_times_both_trainers(tmp_path):
    pytest.importorskip("trl")
    out = tmp_path / "step.json"
    got = _run(
        "bench_grpo_step.py",
        "--steps",
        "1",
        "--prompts",
        "2",
        "--generations",
        "2",
        "--max-completion-length",
        "4",
        "--json",
        str(out),
        out=out,
    )
    for side in ("ours_step_s", "trl_step_s"):
        assert got[side]["n"] == 1 and got[side]["median"] > 0, got[side]


def test_gpu_run_summary_reads_a_run_and_its_memory_traces(tmp_path, fast_run_builds):
    # benchmarks/gpu_check.sh's summary, on a CPU run of the tiny config: per-policy medians from
    # the run's own metrics, the peak of a trace whose last line was cut short, and a run that
    # never started recorded as such rather than failing the whole summary
    from tests.test_paced import run_tiny

    run = tmp_path / "run"
    run_tiny(run, "steps=3", "warmup.max_steps=0")
    # a GPU run's updates also report torch's peak memory (policies/device_memory.py): the
    # summary keeps the largest, the first step's included
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    peaks = iter([5.0, 3.0, 4.0])
    for r in rows:
        if r.get("phase") == "train":
            r["policy/llama-mistral/cuda/peak_allocated_gib"] = next(peaks)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "smi.csv").write_text("1200\n80000\n4100\n41")
    (tmp_path / "apps.csv").write_text("101, 300\n102, 900\n101, 700\n")
    out = tmp_path / "gpu_run.json"
    got = _run(
        "gpu_run_summary.py",
        "--run",
        f"tiny={run}",
        "--smi",
        f"tiny={tmp_path / 'smi.csv'}",
        "--apps",
        f"tiny={tmp_path / 'apps.csv'}",
        "--run",
        f"never={tmp_path / 'never'}",
        "--json",
        str(out),
        out=out,
    )
    tiny = got["runs"]["tiny"]
    assert tiny["finished"] and tiny["steps"] == 3
    assert tiny["gpu_memory_used_peak_mib"] == 80000.0
    assert tiny["gpu_memory_per_process_peak_mib"] == {"101": 700.0, "102": 900.0}
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("phase") == "train"]
    for name in ("llama-mistral", "qwen-deepseek"):
        p = tiny["policies"][name]
        assert p["steps"] == 3
        # the median over the steps after the first (two here: their mean)
        later = [r[f"policy/{name}/step_time_s"] for r in steps[1:]]
        assert p["step_time_s"] == pytest.approx(sum(later) / 2)
        assert p["tokens_per_s"] > 0
    assert tiny["policies"]["llama-mistral"]["cuda/peak_allocated_gib_max"] == 5.0
    assert "cuda/peak_allocated_gib_max" not in tiny["policies"]["qwen-deepseek"]
    assert "error" in got["runs"]["never"]


def test_cold_call_times_the_aligner_back_to_back_and_after_other_work(tmp_path):
    out = tmp_path / "cold.json"
    got = _run("cold_call.py", "--repeats", "2", "--gap-ms", "1", "--json", str(out), out=out)
    conditions = {r["condition"] for r in got["rows"]}
    assert {"back to back", "after a 1 ms sleep", "after a 1 ms Python loop"} <= conditions
    assert all(r["median_ms"] > 0 for r in got["rows"])
    assert {r["over_back_to_back"] for r in got["rows"] if r["condition"] == "back to back"} == {
        1.0
    }


def test_gpu_build_threads_profiles_the_build_and_times_generation_alone_and_in_threads(tmp_path):
    # the GPU probe's own code path, on the CPU and the tiny default config
    out = tmp_path / "probe.json"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "gpu_build_threads.py"),
        "--config",
        "configs/default.toml",
        "--device",
        "cpu",
        "--tokens",
        "4",
        "--repeats",
        "1",
        "--json",
        str(out),
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "==== build llama-mistral" in done.stdout and "by cumulative" in done.stdout
    probe = json.loads(out.read_text())
    assert done.stdout.splitlines()[-1] == "PROBE " + json.dumps(probe)
    assert set(probe["gen_alone_s"]) == {"llama-mistral", "qwen-deepseek"}
    assert len(probe["gen_threads_default_stream_s"]) == 1
    assert "gen_threads_own_streams_s" not in probe  # no streams on the CPU
    assert probe["build_llama-mistral_s"] > 0 and probe["device"] == "cpu"


def _finished_run(run: Path, start: list[int], end: list[int]) -> None:
    """A run folder's held-out records (start, end: greedy pass per prompt) and summary."""
    from mutualrl.run.evaluation import append_heldout

    run.mkdir(parents=True)

    def rec(step, greedy):
        n = len(greedy)
        return {
            "step": step,
            "policy": "p",
            "k": 1,
            "prompt_ids": [f"q{i}" for i in range(n)],
            "families": ["add"] * (n // 2) + ["count"] * (n // 2),
            "greedy": greedy,
            "sampled": greedy,
            "greedy_text": ["x"] * n,
        }

    append_heldout(run, [rec(0, start)])
    append_heldout(run, [rec(30, end)])
    (run / "summary.json").write_text(
        json.dumps(
            {
                "reward_first": {"p": 0.1},
                "reward_last": {"p": 0.4},
                "wall_time_s": 12.0,
                "phase_times_s": {"train": 10.0},
            }
        )
    )


def test_real_cpu_summarises_a_finished_run(tmp_path):
    """--run-dir: a run folder's held-out records and summary become the JSON the results page
    quotes (the training itself needs the real models: CI's real-models step)."""
    run = tmp_path / "run"
    _finished_run(run, [1] * 10 + [0] * 30 + [0] * 40, [1] * 30 + [0] * 10 + [1] * 20 + [0] * 20)
    out = tmp_path / "real_cpu.json"
    got = _run("real_cpu.py", "--run-dir", str(run), "--commit", "abc", "--json", str(out), out=out)
    p = got["policies"]["p"]
    assert got["commit"] == "abc" and got["run_wall_s"] == 12.0
    assert (
        p["heldout_pass@1"]["start"]["mean"] == 0.125
        and p["heldout_pass@1"]["end"]["mean"] == 0.625
    )
    assert p["heldout_pass@1"]["verdict"].startswith("rose")
    assert p["families"] == {
        "add": {"start": 0.25, "end": 0.75, "prompts": 40},
        "count": {"start": 0.0, "end": 0.5, "prompts": 40},
    }
    assert p["train_reward_last_quarter"] == 0.4


def test_real_cpu_records_a_recipe_candidate_with_the_config_it_ran(tmp_path):
    """--run-dir --label: a run of another config (a recipe candidate) is recorded with its own
    config.json and command, its split and pass@1 at each evaluation, under its label."""
    run = tmp_path / "run"
    _finished_run(run, [1] * 10 + [0] * 30 + [0] * 40, [1] * 30 + [0] * 10 + [1] * 20 + [0] * 20)
    (run / "config.json").write_text(json.dumps({"grpo": {"temperature": 0.7}}))
    out = tmp_path / "real_cpu.json"
    got = _run(
        "real_cpu.py",
        "--run-dir",
        str(run),
        "--commit",
        "abc",
        "--label",
        "gemma-t07",
        "--command",
        "mutualrl train --set grpo.temperature=0.7",
        "--json",
        str(out),
        out=out,
    )
    assert got["label"] == "gemma-t07" and got["commit"] == "abc"
    assert got["command"] == "mutualrl train --set grpo.temperature=0.7"
    assert got["run_config"] == {"grpo": {"temperature": 0.7}} and "config_text" not in got
    p = got["policies"]["p"]
    assert p["split"] == "heldout" and p["pass@1_by_step"] == {"0": 0.125, "30": 0.625}


def test_real_cpu_summarises_a_finished_compare_beside_the_single_run(tmp_path):
    """--compare-dir: every run of a compare, and per strategy and policy the seeds' held-out
    start, end and change, written as the run labelled `compare` beside the `real-cpu` run."""
    folder = tmp_path / "compare"
    start = [1] * 20 + [0] * 60
    ends = {("none", 0): 10, ("none", 1): 20, ("sgt", 0): 40, ("sgt", 1): 60}
    for (strategy, seed), correct in ends.items():
        _finished_run(
            folder / "runs" / f"{strategy}-seed{seed}", start, [1] * correct + [0] * (80 - correct)
        )
    state = {
        "config_path": "configs/real-cpu.toml",
        "overrides": ["steps=12"],
        "strategies": ["none", "sgt"],
        "seeds": 2,
        "commit": "abc",
        "runs": {
            f"{st}-seed{se}": {"strategy": st, "seed": se, "status": "done"} for st, se in ends
        },
    }
    (folder / "compare.json").write_text(json.dumps(state))
    out = tmp_path / "real_cpu.json"
    out.write_text(json.dumps({"runs": [{"label": "real-cpu", "x": 1}]}))
    got = _run("real_cpu.py", "--compare-dir", str(folder), "--json", str(out), out=out)
    assert [r["label"] for r in got["runs"]] == ["real-cpu", "compare"]
    compare = got["runs"][1]
    assert compare["command"] == (
        "mutualrl compare --config configs/real-cpu.toml --strategies none,sgt --seeds 2 "
        "--set steps=12"
    )
    sgt = compare["by_strategy"]["sgt"]["p"]
    assert sgt["seeds"] == [0, 1] and sgt["start"] == [0.25, 0.25] and sgt["end"] == [0.5, 0.75]
    assert sgt["end_mean"] == 0.625 and compare["by_strategy"]["none"]["p"]["end_mean"] == 0.1875


def test_real_cpu_summarises_a_tuning_compare_under_its_own_label(tmp_path):
    """--compare-dir --label tune: a tuning compare's arms, its tuning.json and the command that
    made it (the arms as --tune flags), beside the runs already in the JSON."""
    folder = tmp_path / "tune"
    start = [1] * 20 + [0] * 60
    ends = {"none@0": 10, "none@1": 30, "sgt@0": 40, "sgt@1": 20}
    for label, correct in ends.items():
        _finished_run(
            folder / "runs" / f"{label}-seed0", start, [1] * correct + [0] * (80 - correct)
        )
    lrs = [("1e-5", "2.5e-6"), ("2e-5", "5e-6")]
    arms = {
        f"{st}@{i}": {
            "strategy": st,
            "overrides": [
                'eval.split="validation"',
                f"policies.0.learning_rate={a}",
                f"policies.1.learning_rate={b}",
            ],
        }
        for st in ("none", "sgt")
        for i, (a, b) in enumerate(lrs)
    }
    state = {
        "config_path": "configs/real-cpu.toml",
        "overrides": ["steps=15"],
        "strategies": list(arms),
        "arms": arms,
        "seeds": 1,
        "commit": "abc",
        "runs": {f"{a}-seed0": {"strategy": a, "seed": 0, "status": "done"} for a in arms},
    }
    (folder / "compare.json").write_text(json.dumps(state))
    tuning = {"split": "validation", "strategies": {}, "chosen": {"none": {"label": "none@1"}}}
    (folder / "tuning.json").write_text(json.dumps(tuning))
    out = tmp_path / "real_cpu.json"
    out.write_text(json.dumps({"runs": [{"label": "compare", "x": 1}]}))
    got = _run(
        "real_cpu.py", "--compare-dir", str(folder), "--label", "tune", "--json", str(out), out=out
    )
    assert [r["label"] for r in got["runs"]] == ["compare", "tune"]
    tune = got["runs"][1]
    assert tune["command"] == (
        "mutualrl compare --config configs/real-cpu.toml --strategies none,sgt --seeds 1 "
        "--set steps=15 --tune policies.0.learning_rate=1e-5,2e-5 "
        "--tune policies.1.learning_rate=2.5e-6,5e-6"
    )
    assert tune["arms"] == arms and tune["tuning"] == tuning
    assert tune["by_strategy"]["none@1"]["p"]["end"] == [0.375]


def _compare_folder(
    folder: Path, ends: dict, done: set, overrides=("steps=30",), first_seed: int = 0
) -> None:
    """A compare of strategies x seeds whose runs in ``done`` are finished (held-out start 0.25,
    end ``ends[(strategy, seed)] / 80``)."""
    for (strategy, seed), correct in ends.items():
        if (strategy, seed) in done:
            _finished_run(
                folder / "runs" / f"{strategy}-seed{seed}",
                [1] * 20 + [0] * 60,
                [1] * correct + [0] * (80 - correct),
            )
    state = {
        "config_path": "configs/real-cpu.toml",
        "overrides": list(overrides),
        "strategies": sorted({st for st, _ in ends}),
        "seeds": 1 + max(se for _, se in ends) - first_seed,
        **({"first_seed": first_seed} if first_seed else {}),
        "commit": "abc",
        "runs": {
            f"{st}-seed{se}": {
                "strategy": st,
                "seed": se,
                "status": "done" if (st, se) in done else "pending",
            }
            for st, se in ends
        },
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "compare.json").write_text(json.dumps(state))


def test_real_cpu_records_a_compare_as_it_goes_and_finishes_it_from_another_folder(tmp_path):
    """--compare-dir on an unfinished compare: its finished runs with their per-problem results,
    the rest pending; the same compare finished in another folder (a new machine) adds its runs
    to the record, and real_compare.py draws the table from the record alone."""
    ends = {("none", 0): 20, ("none", 1): 24, ("sgt", 0): 40, ("sgt", 1): 60}
    out = tmp_path / "real_cpu.json"
    out.write_text(json.dumps({"runs": [{"label": "real-cpu", "x": 1}]}))
    first = tmp_path / "first"
    _compare_folder(first, ends, {("none", 0), ("sgt", 0)})
    got = _run("real_cpu.py", "--compare-dir", str(first), "--json", str(out), out=out)
    rec = got["runs"][1]
    assert rec["runs_done"] == 2 and rec["pending"] == ["none-seed1", "sgt-seed1"]
    assert rec["problems_by_seed"]["0"]["ids"] == [f"q{i}" for i in range(80)]
    assert rec["runs"]["sgt-seed0"]["policies"]["p"]["greedy_by_step"] == {
        "0": "1" * 20 + "0" * 60,
        "30": "1" * 40 + "0" * 40,
    }
    # the rest of it in a fresh folder: the first folder's runs are kept from the record
    second = tmp_path / "second"
    _compare_folder(second, ends, {("none", 1), ("sgt", 1)})
    got = _run("real_cpu.py", "--compare-dir", str(second), "--json", str(out), out=out)
    rec = got["runs"][1]
    assert rec["runs_done"] == 4 and rec["pending"] == []
    assert rec["by_strategy"]["sgt"]["p"]["end"] == [0.5, 0.75]
    # another compare under the same label is refused, the file untouched
    other = tmp_path / "other"
    _compare_folder(other, ends, set(ends), overrides=("steps=12",))
    before = out.read_text()
    cmd = [sys.executable, str(ROOT / "benchmarks" / "real_cpu.py"), "--compare-dir", str(other)]
    done = subprocess.run([*cmd, "--json", str(out)], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode != 0 and "is another compare" in done.stderr
    assert out.read_text() == before
    # the table: sgt's paired difference to none over both seeds and the 80 problems
    cmd = [sys.executable, str(ROOT / "benchmarks" / "real_compare.py"), "--json", str(out)]
    done = subprocess.run(
        [*cmd, "--tuned", "compare", "--plots", str(tmp_path / "img")],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    sgt = next(line for line in done.stdout.splitlines() if line.startswith("| `sgt`"))
    assert "| 2 | 0.62 ± 0.18 | +0.35 [" in sgt
    assert (tmp_path / "img" / "real-compare-p.png").stat().st_size > 0
    # the shared default's compare beside it: sgt's tuned runs stand in for its default there
    dflt = tmp_path / "dflt"
    _compare_folder(dflt, {("none", 0): 30, ("none", 1): 30}, {("none", 0), ("none", 1)})
    _run("real_cpu.py", "--compare-dir", str(dflt), "--label", "dflt", "--json", str(out), out=out)
    done = subprocess.run(
        [*cmd, "--tuned", "compare", "--default", "dflt", "--same-as-default", "sgt"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    table = done.stdout.split("(run 'dflt')")[1]
    assert "| `sgt` | shared default (its tuned runs) | 2 | 0.62 ± 0.18 | +0.25 [" in table


def test_real_cpu_merges_the_parts_of_a_comparison_run_one_seed_after_another(tmp_path):
    """A comparison run in parts (--seeds 1, then --seeds 2 --first-seed 1 in another folder)
    is recorded as one: the whole command, the parts' commands, every seed's runs."""
    out = tmp_path / "real_cpu.json"
    first = tmp_path / "first"
    _compare_folder(first, {("none", 0): 20, ("sgt", 0): 40}, {("none", 0), ("sgt", 0)})
    _run("real_cpu.py", "--compare-dir", str(first), "--json", str(out), out=out)
    rest = {(st, se): 30 for st in ("none", "sgt") for se in (1, 2)}
    second = tmp_path / "second"
    _compare_folder(second, rest, {("none", 1), ("sgt", 1)}, first_seed=1)
    got = _run("real_cpu.py", "--compare-dir", str(second), "--json", str(out), out=out)
    head = "mutualrl compare --config configs/real-cpu.toml --strategies none,sgt"
    assert got["command"] == f"{head} --seeds 3 --set steps=30"
    assert got["parts"] == [
        f"{head} --seeds 1 --set steps=30",
        f"{head} --seeds 2 --first-seed 1 --set steps=30",
    ]
    assert got["seed_list"] == [0, 1, 2] and got["runs_done"] == 4
    assert got["pending"] == ["none-seed2", "sgt-seed2"]
    assert got["by_strategy"]["sgt"]["p"]["seeds"] == [0, 1]
    # a third part runs one more regime on seed 0: the comparison grows by that regime
    third = tmp_path / "third"
    _compare_folder(third, {("hint", 0): 50}, {("hint", 0)})
    got = _run("real_cpu.py", "--compare-dir", str(third), "--json", str(out), out=out)
    assert got["command"] == f"{head[:-8]}hint,none,sgt --seeds 3 --set steps=30"
    assert got["strategies"] == ["hint", "none", "sgt"] and got["runs_done"] == 5


def test_trl_check_trains_with_trl_and_scores_trl_and_a_mutualrl_run_by_one_evaluation(tmp_path):
    """benchmarks/trl_check.py on a tiny random Llama folder: TRL's GRPOTrainer trains it on the
    run's prompts, and the start, TRL's weights and a mutualrl `none` run of the same config are
    each scored by mutualrl's evaluation (distinct problems of the config's split)."""
    pytest.importorskip("trl")
    from transformers import AutoModelForCausalLM, LlamaConfig

    from mutualrl.retokenize.loaders import load_tokenizer

    tok = load_tokenizer("mistral-v1").tokenizer
    model_cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    folder = tmp_path / "ckpt"
    AutoModelForCausalLM.from_config(model_cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    config = tmp_path / "run.toml"
    config.write_text(
        f'seed = 0\nsteps = 1\nstrategy = "none"\noutput_dir = "{tmp_path / "none"}"\n'
        "[grpo]\nnum_generations = 2\nprompts_per_step = 2\nmax_completion_length = 4\n"
        "[warmup]\nmax_steps = 0\n[eval]\nevery = 0\nnum_prompts = 3\n"
        '[task]\nname = "arithmetic"\nfamilies = ["add", "mul"]\n'
        f'[[policies]]\nname = "p"\ncheckpoint = "{folder}"\n'
    )
    done = subprocess.run(
        [sys.executable, "-m", "mutualrl.cli", "train", "--config", str(config), "--no-progress"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "trl.json"
    got = _run(
        "trl_check.py", "--config", str(config), "--policy", "p", "--seeds", "0",
        "--mutualrl-run", f"0={tmp_path / 'none'}", "--work", str(tmp_path / "work"),
        "--json", str(out), out=out,
    )  # fmt: skip
    (seed,) = got["seeds"]
    assert seed["steps"] == 1 and len(seed["trl_log"]) == 1
    for side in ("start", "trl", "mutualrl"):
        assert seed[side]["prompts"] == 6 and seed[side]["split"] == "heldout"
        assert set(seed[side]["families"]) == {"add", "mul"}
        assert 0 <= seed[side]["pass@1"]["lo"] <= seed[side]["pass@1"]["hi"] <= 1
    assert (tmp_path / "work" / "seed0" / "trl" / "final" / "model.safetensors").is_file()
