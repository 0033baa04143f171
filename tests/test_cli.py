"""The ``mutualrl`` command line, run in-process through ``mutualrl.cli.main``."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from mutualrl.cli import _overrides, main
from mutualrl.run.metrics import read_metrics
from mutualrl.strategies import STRATEGIES

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.toml")


def test_train_help_lists_the_registered_strategies(capsys):
    with pytest.raises(SystemExit) as info:
        main(["train", "--help"])
    assert info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    names = STRATEGIES.names()
    assert "none" in names
    for name in names:
        assert name in out, name
    assert "--config" in out and "--set" in out and "--no-progress" in out


def test_top_level_help_names_strategies_and_train(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "train" in out and "none" in out


def test_no_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_unknown_strategy_exits_2_with_the_known_names(capsys, tmp_path):
    out = tmp_path / "never"
    code = main(
        [
            "train",
            "--config",
            TINY,
            "--strategy",
            "bogus",
            "--output-dir",
            str(out),
            "--no-progress",
        ]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "bogus" in err
    for name in STRATEGIES.names():
        assert name in err
    assert not out.exists()


def test_bad_override_exits_2_with_the_field_path(capsys, tmp_path):
    out = tmp_path / "never"
    code = main(["train", "--config", TINY, "--set", "grpo.beta=-1", "--output-dir", str(out)])
    assert code == 2
    err = capsys.readouterr().err
    assert "`$.grpo`" in err and "beta must be >= 0" in err
    assert err.startswith("mutualrl: error:")
    assert not out.exists()


def test_missing_config_exits_2_naming_the_file(capsys, tmp_path):
    missing = tmp_path / "nope.toml"
    assert main(["train", "--config", str(missing)]) == 2
    assert str(missing) in capsys.readouterr().err


def test_smoke_train_returns_0(tmp_path, fast_run_builds, capsys):
    out = tmp_path / "run"
    code = main(
        ["train", "--config", TINY, "--output-dir", str(out), "--steps", "1", "--no-progress"]
    )
    assert code == 0
    assert (out / "summary.json").is_file()
    train = [r for r in read_metrics(out / "metrics.jsonl") if r["phase"] == "train"]
    assert [r["step"] for r in train] == [0]  # --steps overrode the config's 2
    err = capsys.readouterr().err
    assert str(out) in err  # "done ... -> <run dir>"
    # the two train rewards are means over a quarter of the steps each, and the line says so
    assert "train reward, mean of the first -> last quarter of the steps" in err
    assert "llama-mistral: " in err and "; pass@1 " in err


def _args(**kw):
    base = dict(set=[], strategy=None, output_dir=None, steps=None, peer_log=[])
    base.update(kw)
    return argparse.Namespace(**base)


def test_flags_become_overrides():
    assert _overrides(
        _args(set=["grpo.beta=0.1"], strategy="none", output_dir="/tmp/x", steps=3)
    ) == ["grpo.beta=0.1", 'strategy="none"', 'output_dir="/tmp/x"', "steps=3"]
    assert _overrides(_args(steps=0)) == ["steps=0"]  # 0 is a value, not "unset"


def test_every_peer_log_flag_is_kept():
    from mutualrl.config import apply_override

    data: dict = {}
    for item in _overrides(_args(peer_log=["runs/a", "runs/b"])):
        apply_override(data, item)
    assert data["exchange"]["peer_logs"] == ["runs/a", "runs/b"]


def test_output_dir_that_is_a_file_is_a_one_line_error(capsys, tmp_path):
    path = tmp_path / "taken"
    path.write_text("not a run directory")
    assert main(["train", "--config", TINY, "--output-dir", str(path), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--output-dir" in err[0] and "output_dir" in err[0]
    assert "existing file" in err[0] and "Traceback" not in err[0]
    assert path.read_text() == "not a run directory"
