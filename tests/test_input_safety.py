"""No input destroys a run or the user's files: names are data, CLI paths are values, damage in a
run's records is found before a resume trains, an unwritable folder is one error.

Each case was a defect found by running the command line: a policy named ".." whose final save
deleted the working directory, a folder name holding '"' or "\\t" that broke or changed the run
folder, damage in metrics.jsonl found only after a whole resumed run (naming no file), --overwrite
deleting a user's config.json, an OSError traceback for an output folder that cannot be written.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
from pathlib import Path

import pytest

from mutualrl.cli import _overrides, main
from mutualrl.config import ConfigError, load_config
from mutualrl.run.folder import LOCK_FILE, claim
from mutualrl.run.metrics import read_metrics
from mutualrl.storage import OutsideFolder, atomic_folder, remove_tree

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.toml")


def train(out: str | Path, *extra: str) -> int:
    return main(
        [
            "train",
            "--config",
            TINY,
            "--output-dir",
            str(out),
            "--no-progress",
            "--steps",
            "1",
            *extra,
        ]
    )


def one_line_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("mutualrl: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ---- policy names ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["..", ".", "a b", "a\\\\b", "x" * 65, "ä"])
def test_a_policy_name_outside_the_safe_set_is_refused_at_load(name):
    with pytest.raises(ConfigError) as info:
        load_config(TINY, [f'policies.0.name="{name}"'])
    msg = str(info.value)
    assert "`$.policies[0]`" in msg and "name" in msg and "letters, digits" in msg
    assert "\n" not in msg


def test_a_policy_named_dotdot_into_sub_dotdot_deletes_nothing(tmp_path, monkeypatch, capsys):
    """The reported command: the final save replaced RUN_DIR/policies/.. = RUN_DIR = the cwd."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.txt").write_text("the user's")
    code = train("sub/..", "--set", 'policies.0.name=".."')
    assert code == 2
    assert "policies[0]" in one_line_error(capsys.readouterr().err)
    assert (tmp_path / "mine.txt").read_text() == "the user's"
    assert not (tmp_path / "metrics.jsonl").exists()


def test_atomic_folder_never_replaces_its_parent_or_anything_outside(tmp_path):
    run = tmp_path / "run"
    (run / "policies").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(OutsideFolder, match="not strictly inside"):
        with atomic_folder(run / "policies" / "..", "policy '..'"):
            pass
    with pytest.raises(OutsideFolder):
        with atomic_folder(run / "policies" / ".", "policy '.'", within=run / "policies"):
            pass
    assert (run / "metrics.jsonl").read_text() == "{}\n"
    assert sorted(p.name for p in (run / "policies").iterdir()) == []  # no temporary left
    with atomic_folder(run / "policies" / "p", "policy 'p'") as tmp:
        (tmp / "w").write_text("1")
    assert (run / "policies" / "p" / "w").read_text() == "1"


def test_remove_tree_removes_only_inside_and_a_link_not_its_target(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("k")
    run = tmp_path / "run"
    run.mkdir()
    (run / "link").symlink_to(outside)
    for path in (run, run / "..", tmp_path / "elsewhere", run / "sub" / ".." / ".."):
        with pytest.raises(OutsideFolder):
            remove_tree(path, within=run)
    remove_tree(run / "link", within=run)
    assert not (run / "link").exists() and (outside / "keep").read_text() == "k"


# ---- --overwrite deletes a run's files only ------------------------------------------------------
def test_overwrite_never_deletes_run_named_files_no_run_wrote(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"mine": true}')
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "model.bin").write_text("weights")
    for overwrite in (False, True):
        with pytest.raises(ConfigError, match="no run wrote this folder"):
            claim(tmp_path, overwrite=overwrite)
    assert (tmp_path / "config.json").read_text() == '{"mine": true}'
    assert (tmp_path / "checkpoints" / "model.bin").read_text() == "weights"
    assert not (tmp_path / LOCK_FILE).exists()  # a refusal marks nothing as a run's


def test_overwrite_removes_a_linked_run_folder_entry_not_what_it_points_to(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("k")
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_FILE).write_text("pid 1: mutualrl train\n")
    (run / "policies").symlink_to(elsewhere)
    claim(run, overwrite=True).release()
    assert not (run / "policies").exists() and (elsewhere / "keep").read_text() == "k"


# ---- CLI paths reach the config as values --------------------------------------------------------
ODD = 'odd \\t "quoted" name'  # a backslash-t (not a tab), quotes and spaces


def test_every_cli_path_reaches_the_config_unchanged(tmp_path):
    args = argparse.Namespace(
        set=[],
        strategy='no"ne',
        output_dir=str(tmp_path / ODD),
        steps=1,
        peer_log=[str(tmp_path / ODD), "tab\there\x7f"],
    )
    data = {}
    from mutualrl.config import apply_override

    for item in _overrides(args):
        apply_override(data, item)
    assert data == {
        "strategy": 'no"ne',
        "output_dir": str(tmp_path / ODD),
        "steps": 1,
        "exchange": {"peer_logs": [str(tmp_path / ODD), "tab\there\x7f"]},
    }


def test_compare_paths_reach_the_config_unchanged(tmp_path):
    from mutualrl.compare import plan_runs

    out = tmp_path / (ODD + "\udc8f")  # a byte that is not UTF-8, as Python reads a name
    [r] = plan_runs(TINY, ["none"], 1, out, [])
    assert r.cfg.output_dir == str(out / "runs" / "none-seed0")
    assert r.cfg.warmup.cache_dir == str(out / "warmstart")


def test_a_run_folder_named_with_quotes_and_backslashes_trains_and_resumes(
    tmp_path, fast_run_builds, capsys
):
    out = tmp_path / ODD
    assert train(out, "--set", "save_steps=1") == 0
    assert json.loads((out / "config.json").read_text())["output_dir"] == str(out)
    assert main(["train", "--resume", str(out), "--steps", "2", "--no-progress"]) == 0
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl") if r["phase"] == "train"]
    assert steps == [0, 1]
    assert sorted(p.name for p in tmp_path.iterdir()) == [ODD]


# ---- damage is found before a resume trains ------------------------------------------------------
@pytest.fixture
def checkpointed(tmp_path, fast_run_builds):
    out = tmp_path / "run"
    assert train(out, "--set", "save_steps=1") == 0
    return out


def _damage(path: Path, at: int, byte: bytes) -> None:
    data = bytearray(path.read_bytes())
    data[at : at + 1] = byte
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "name, byte, what",
    [
        ("metrics.jsonl", b"\x8f", "not valid UTF-8"),
        ("heldout.jsonl", b"}", "not valid JSON"),
        ("failures.jsonl", b"\xff", "not valid UTF-8"),
    ],
)
def test_resume_names_damage_before_the_checkpoint_before_any_step(
    checkpointed, capsys, name, byte, what
):
    path = checkpointed / name
    if name == "failures.jsonl":
        path.write_text('{"policy": "a", "step": 0}\n{"policy": "b", "step": 1}\n')
    _damage(path, 20, byte)
    before = {
        p.name: p.read_bytes()
        for p in checkpointed.iterdir()
        if p.is_file() and p.name != LOCK_FILE
    }
    capsys.readouterr()
    assert main(["train", "--resume", str(checkpointed), "--steps", "2", "--no-progress"]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert f"{path}: byte 20 (line 1): {what}" in line and "--resume" in line
    after = {
        p.name: p.read_bytes()
        for p in checkpointed.iterdir()
        if p.is_file() and p.name != LOCK_FILE
    }
    assert after == before  # no step ran, nothing was cut back or appended


def test_reading_damaged_metrics_names_the_file_and_byte(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"a": 1}\n{"b": "\x8f"}\n')
    with pytest.raises(ConfigError, match=rf"{path}: byte 16 \(line 2\): not valid UTF-8"):
        read_metrics(path)


def test_a_recorded_length_inside_a_line_is_damage(tmp_path):
    from mutualrl.run.jsonl import check_records

    (tmp_path / "metrics.jsonl").write_text('{"a": 1}\n{"b": 2}\n')
    check_records(tmp_path, {"metrics.jsonl": 9}, "step-000001")
    with pytest.raises(ConfigError, match="byte 9 .*runs past byte 12"):
        check_records(tmp_path, {"metrics.jsonl": 12}, "step-000001")


# ---- an output folder that cannot be written -----------------------------------------------------
def test_an_output_folder_under_a_file_is_one_error(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "run"
    assert train(out) == 2
    line = one_line_error(capsys.readouterr().err)
    assert str(out) in line and "not a directory" in line


def _read_only(monkeypatch, where: Path) -> None:
    """Writes under ``where`` fail as on a read-only mount (root ignores chmod)."""
    real_mkdir, real_open, real_path_open = os.mkdir, os.open, Path.open

    def refuse(path):
        if Path(path).is_relative_to(where):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    def mkdir(path, *a, **k):
        refuse(path)
        return real_mkdir(path, *a, **k)

    def open_(path, flags, *a, **k):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            refuse(path)
        return real_open(path, flags, *a, **k)

    def path_open(self, mode="r", *a, **k):
        if set(mode) & set("wax+"):
            refuse(self)
        return real_path_open(self, mode, *a, **k)

    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(Path, "open", path_open)


@pytest.mark.parametrize("exists", [False, True])
def test_a_read_only_output_folder_is_one_error_and_nothing_is_written(
    tmp_path, monkeypatch, capsys, exists
):
    ro = tmp_path / "ro"
    ro.mkdir()
    out = ro / "new" / "run"
    if exists:
        out.mkdir(parents=True)
    _read_only(monkeypatch, ro)
    assert train(out) == 2
    line = one_line_error(capsys.readouterr().err)
    assert str(out) in line and "read-only file system" in line
    monkeypatch.undo()
    assert [str(p.relative_to(ro)) for p in ro.rglob("*")] == (["new", "new/run"] if exists else [])
