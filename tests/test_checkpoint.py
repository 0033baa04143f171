"""Checkpoints: atomic and verified, damaged ones skipped, configs checked, compare resumes runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mutualrl.compare import compare, read_state
from mutualrl.config import ConfigError, load_config
from mutualrl.provenance import source_digest
from mutualrl.run import checkpoint, train
from mutualrl.run.metrics import read_metrics
from mutualrl.run.resume import config_differences

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"


def tiny(out: Path, *sets: str):
    return load_config(TINY, [f'output_dir="{out}"', "save_steps=1", 'strategy="sgt"', *sets])


@pytest.fixture(scope="module")
def tiny_run(module_tmp, fast_run_builds_module) -> Path:
    out = module_tmp("ckpt") / "run"
    train(tiny(out))
    return out


def test_every_save_step_leaves_a_complete_verified_checkpoint(tiny_run):
    paths = sorted((tiny_run / "checkpoints").iterdir())
    assert [p.name for p in paths] == ["step-000001", "step-000002"]
    for p in paths:
        assert checkpoint.verify(p) is None
        manifest = json.loads((p / "manifest.json").read_text())
        assert set(manifest["files"]) >= {
            "run.msgpack",
            "strategy.msgpack",
            "policies/llama-mistral/state.pt",
            "policies/qwen-deepseek/state.pt",
        }
    state = checkpoint.latest(tiny_run).state
    assert state["step"] == 2 and state["bus"]["next_seq"]["llama-mistral"] > 0
    assert set(state["strategy"]) == {"buffer", "duplicates", "failed"}


def test_a_damaged_checkpoint_is_reported_and_the_previous_one_used(tiny_run, tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(tiny_run, run_dir)
    state = run_dir / "checkpoints" / "step-000002" / "policies" / "llama-mistral" / "state.pt"
    state.write_bytes(state.read_bytes()[:-10] + b"0123456789")
    notes: list[str] = []
    found = checkpoint.latest(run_dir, report=notes.append)
    assert found is not None and found.step == 1
    assert len(notes) == 1 and "state.pt does not match its checksum" in notes[0]
    (run_dir / "checkpoints" / "step-000001" / "manifest.json").unlink()  # a write cut short
    assert checkpoint.latest(run_dir, report=notes.append) is None
    assert "no manifest" in notes[-1]


def test_save_total_limit_keeps_the_newest(tmp_path, fast_run_builds):
    out = tmp_path / "run"
    train(tiny(out, "save_total_limit=1", "steps=3"))
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-000003"]


def test_resume_refuses_a_config_that_changes_what_is_computed(tiny_run, tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(tiny_run, run_dir)
    before = (run_dir / "metrics.jsonl").read_bytes()
    with pytest.raises(ConfigError, match=r"grpo\.beta.*seed|seed.*grpo\.beta"):
        train(tiny(run_dir, "grpo.beta=0.1", "seed=3"), resume=True)
    assert (run_dir / "metrics.jsonl").read_bytes() == before  # nothing cut, nothing lost


def test_resume_continues_and_lists_harmless_changes(tiny_run, tmp_path, fast_run_builds):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(tiny_run, run_dir)
    train(tiny(run_dir, "steps=3", "eval.num_prompts=2"), resume=True)
    records = read_metrics(run_dir / "metrics.jsonl")
    resumed = [r for r in records if r["phase"] == "resume"]
    assert len(resumed) == 1 and resumed[0]["step"] == 2
    # the copy lives elsewhere, so output_dir differs too
    assert set(resumed[0]["changed_harmless"]) == {"steps", "eval.num_prompts", "output_dir"}
    assert [r["step"] for r in records if r["phase"] == "train"] == [0, 1, 2]
    # evaluations sample from the policies' generators: said; a constant schedule: nothing to say
    [note] = resumed[0]["changes_what_follows"]
    assert note.startswith("eval.num_prompts changed: evaluations sample from each policy's own")


def test_resume_says_a_schedule_takes_the_new_number_of_steps(tmp_path):
    from mutualrl.run.resume import resume_notes

    cfg = tiny(tmp_path / "run", "steps=8", 'training.lr_scheduler_type="linear"')
    [note] = resume_notes(["steps"], cfg)
    assert "'linear') now spans the run's 8 steps" in note
    assert resume_notes(["steps", "save_steps"], tiny(tmp_path / "run", "steps=8")) == []


def test_resume_without_a_checkpoint_says_how_to_get_one(tmp_path):
    (tmp_path / "run").mkdir()
    with pytest.raises(ConfigError, match="save_steps"):
        train(tiny(tmp_path / "run"), resume=True)


def test_config_differences_split_harmless_from_refused():
    old = {
        "seed": 0,
        "steps": 5,
        "eval": {"every": 2},
        "grpo": {"beta": 0.0},
        "policies": [{"name": "a", "hidden_size": 64}],
    }
    new = {
        "seed": 0,
        "steps": 9,
        "eval": {"every": 3},
        "grpo": {"beta": 0.0},
        "policies": [{"name": "a", "hidden_size": 32}],
    }
    assert config_differences(old, new) == (
        ["policies.0.hidden_size"],
        ["eval.every", "steps"],
    )


def test_compare_resume_continues_an_interrupted_run_from_its_checkpoint(tmp_path, fast_run_builds):
    out = tmp_path / "report"
    sets = ["save_steps=1", "steps=2", "eval.num_prompts=2", "warmup.max_steps=1"]
    calls: list[bool] = []

    def interrupted(cfg, progress, resume=False):
        calls.append(resume)
        if not resume:  # train one step (checkpoint 1), then stop as if the machine died
            train(load_config(TINY, [f'output_dir="{cfg.output_dir}"', *sets, "steps=1"]))
            (Path(cfg.output_dir) / "summary.json").unlink()
            raise KeyboardInterrupt
        return train(cfg, progress, resume=True)

    with pytest.raises(KeyboardInterrupt):
        compare(str(TINY), ["none"], 1, out, overrides=sets, train_fn=interrupted)
    compare(str(TINY), ["none"], 1, out, overrides=sets, resume=True, train_fn=interrupted)
    assert calls == [False, True]
    assert read_state(out)["runs"]["none-seed0"]["status"] == "done"
    records = read_metrics(out / "runs" / "none-seed0" / "metrics.jsonl")
    assert [r["step"] for r in records if r["phase"] == "resume"] == [1]
    assert [r["step"] for r in records if r["phase"] == "train"] == [0, 1]


def test_source_digest_covers_the_code(monkeypatch, tmp_path):
    import mutualrl.provenance as prov

    pkg = tmp_path / "mutualrl"
    pkg.mkdir()
    (pkg / "a.py").write_text("x = 1\n")
    monkeypatch.setattr(prov, "__file__", str(pkg / "provenance.py"))
    first = prov.source_digest()
    (pkg / "a.py").write_text("x = 2\n")
    assert prov.source_digest() != first
    assert len(source_digest()) == 16
