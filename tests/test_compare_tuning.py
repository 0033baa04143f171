"""Per-strategy tuning on the validation split (``mutualrl compare --tune`` / ``--tuned``): every
strategy gets the same settings, each is scored on validation, the best is written to
tuning.json, and a tuned compare runs each strategy at its own choice on the held-out split."""

from __future__ import annotations

import json
import math
from pathlib import Path

import msgspec
import pytest

from mutualrl.cli import main
from mutualrl.compare import compare, read_state
from mutualrl.compare.tuning import (
    TUNING_FILE,
    parse_tune,
    tuned_arms,
    tuning_arms,
    tuning_lines,
    write_tuning,
)
from mutualrl.config import ConfigError, to_dict
from mutualrl.run import RunSummary
from tests.test_compare import _config

# Each strategy's best learning rate in the fake: none learns best at 1e-3, sgt at 1e-2.
BEST = {"none": -3.0, "sgt": -2.0}


def lr_train(cfg, progress) -> RunSummary:
    """A run whose final pass@1 peaks at its strategy's best learning rate; the split it was
    evaluated on is recorded in its config."""
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(to_dict(cfg)))
    (out / "metrics.jsonl").write_text("")
    score = max(0.0, 1 - abs(math.log10(cfg.grpo.learning_rate) - BEST[cfg.strategy]) / 4)
    final = {f"policy/{p.name}/heldout/pass@1": score for p in cfg.policies}
    summary = RunSummary(str(out), {}, {}, final, 1.0, {"train": 1.0})
    (out / "summary.json").write_bytes(msgspec.json.encode(summary))
    return summary


def test_zipped_keys_give_one_setting_per_value():
    assert parse_tune(["a=1,2", "b=x, y"]) == [("a=1", "b=x"), ("a=2", "b=y")]
    with pytest.raises(
        ConfigError, match=r"^--tune: zipped keys need as many values each; got a 2, b 3$"
    ):
        parse_tune(["a=1,2", "b=x,y,z"])
    with pytest.raises(ConfigError, match=r"^--tune: expected KEY=V1,V2"):
        parse_tune(["grpo.learning_rate"])


def test_each_strategy_is_tuned_on_validation_and_run_at_its_own_choice(tmp_path):
    config, sets = _config()
    settings = parse_tune(["grpo.learning_rate=1e-4,1e-3,1e-2"])
    tune = tmp_path / "tune"
    compare(config, ["none", "sgt"], 2, tune, overrides=sets,
            arms=tuning_arms(["none", "sgt"], settings), train_fn=lr_train)  # fmt: skip
    state = read_state(tune)
    assert sorted(state["runs"]) == sorted(
        f"{s}@{i}-seed{k}" for s in ("none", "sgt") for i in range(3) for k in range(2)
    )
    for name in state["runs"]:  # every tuning run evaluates the validation split
        assert json.loads((tune / "runs" / name / "config.json").read_text())["eval"]["split"] == (
            "validation"
        )
    tuning = write_tuning(tune, state)
    assert tuning == json.loads((tune / TUNING_FILE).read_text())
    assert tuning["chosen"]["none"]["overrides"] == ["grpo.learning_rate=1e-3"]
    assert tuning["chosen"]["sgt"]["overrides"] == ["grpo.learning_rate=1e-2"]
    assert [s["validation_pass@1"] for s in tuning["strategies"]["sgt"]["settings"]] == [
        0.5, 0.75, 1.0
    ]  # fmt: skip
    assert tuning_lines(tuning)[1] == (
        "sgt: grpo.learning_rate=1e-4: 0.500, grpo.learning_rate=1e-3: 0.750, "
        "grpo.learning_rate=1e-2: 1.000 -> grpo.learning_rate=1e-2"
    )
    assert '- `sgt@2`: `sgt` with `eval.split="validation"`, `grpo.learning_rate=1e-2`' in (
        (tune / "report.md").read_text()
    )
    final = tmp_path / "final"
    compare(config, ["none", "sgt"], 1, final, overrides=sets,
            arms=tuned_arms(["none", "sgt"], tune), train_fn=lr_train)  # fmt: skip
    ran = {
        name: json.loads((final / "runs" / name / "config.json").read_text())
        for name in read_state(final)["runs"]
    }
    assert {n: (c["grpo"]["learning_rate"], c["eval"]["split"]) for n, c in ran.items()} == {
        "none-seed0": (1e-3, "heldout"),
        "sgt-seed0": (1e-2, "heldout"),
    }
    assert "- `sgt`: `sgt` with `grpo.learning_rate=1e-2`" in (final / "report.md").read_text()
    assert write_tuning(final, read_state(final)) is None  # a tuned compare chooses nothing
    assert not (final / TUNING_FILE).exists()
    # resuming the tuned compare with another tuning is another compare
    (tune / TUNING_FILE).write_text(
        json.dumps({**tuning, "chosen": {**tuning["chosen"], "sgt": tuning["chosen"]["none"]}})
    )
    with pytest.raises(ConfigError, match="holds a different compare .*arms"):
        compare(config, ["none", "sgt"], 1, final, overrides=sets, resume=True,
                arms=tuned_arms(["none", "sgt"], tune), train_fn=lr_train)  # fmt: skip


def test_a_tuning_that_is_not_there_or_not_on_validation_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^--tuned: cannot read .*tuning.json"):
        tuned_arms(["none"], tmp_path)
    (tmp_path / TUNING_FILE).write_text(json.dumps({"split": "heldout", "chosen": {}}))
    with pytest.raises(ConfigError, match=r"chosen on the 'heldout' split; settings are chosen on"):
        tuned_arms(["none"], tmp_path)
    (tmp_path / TUNING_FILE).write_text(json.dumps({"split": "validation", "chosen": {}}))
    with pytest.raises(ConfigError, match=r"has no setting for \['none'\]"):
        tuned_arms(["none"], tmp_path)


def test_tune_and_tuned_together_are_refused(tmp_path, capsys):
    rc = main(["compare", "--config", "tiny", "--strategies", "none", "--tune", "seed=1,2",
               "--tuned", str(tmp_path), "--output-dir", str(tmp_path / "c")])  # fmt: skip
    assert rc == 2
    assert "--tune chooses settings and --tuned uses them" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()
