"""A run folder has one writer and is never silently reused; bad input fails before any write.

Each case was a defect found by running the command line as a user would: two writers on one
folder both exiting 0, a fresh run appending to an old run's files, a failed validation replacing
the old run's config.json, a --set typo becoming a folder named '"runs', inf accepted as a
temperature.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mutualrl.cli import main
from mutualrl.config import ConfigError, load_config
from mutualrl.run.folder import LOCK_FILE, claim

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.toml")


def train(out: Path, *extra: str) -> int:
    return main(
        [
            "train",
            "--config",
            TINY,
            "--output-dir",
            str(out),
            "--no-progress",
            "--set",
            "steps=1",
            *extra,
        ]
    )


def test_a_second_writer_fails_at_once_naming_the_holder(tmp_path, capsys):
    out = tmp_path / "run"
    with claim(out):
        assert train(out) == 2
        err = capsys.readouterr().err
        assert "another mutualrl process is writing this run folder" in err
        assert "pid" in err
        assert main(["train", "--resume", str(out), "--config", TINY, "--no-progress"]) == 2
        assert "another mutualrl process" in capsys.readouterr().err
    assert not (out / "metrics.jsonl").exists()  # the refused runs wrote nothing


def test_a_lock_in_another_process_blocks_and_a_dead_holders_lock_does_not(tmp_path):
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from mutualrl.run.folder import claim; "
            f"c = claim({str(out)!r}); print('held', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=f"pid {holder.pid}"):
            claim(out)
    finally:
        holder.kill()
        holder.wait()
    assert (out / LOCK_FILE).exists()  # the dead holder's note is still there ...
    with claim(out):  # ... and blocks nothing: the kernel dropped its lock
        pass


def test_a_fresh_run_refuses_a_folder_holding_a_run_and_overwrite_starts_afresh(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / LOCK_FILE).write_text("pid 1: mutualrl train\n")  # a run's note: it wrote here
    (out / "metrics.jsonl").write_text('{"phase": "warmup", "step": 1}\n')
    before = (out / "metrics.jsonl").read_bytes()
    assert train(out) == 2
    err = capsys.readouterr().err
    assert "already holds a run" in err and "--resume" in err and "--overwrite" in err
    assert (out / "metrics.jsonl").read_bytes() == before and not (out / "config.json").exists()
    assert train(out, "--overwrite") == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {"phase": "warmup", "step": 1} not in rows  # the old run's row is gone
    assert sum(r["phase"] == "train" for r in rows) == 1  # one fresh run's rows


def test_a_run_that_fails_validation_leaves_the_old_run_untouched(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text('{"old": true}')
    code = train(out, "--overwrite", "--peer-log", str(tmp_path / "missing"))
    assert code == 2 and "exchange.peer_logs" in capsys.readouterr().err
    assert (out / "config.json").read_text() == '{"old": true}'


def test_resume_of_a_folder_that_does_not_exist_creates_nothing(tmp_path, capsys):
    out = tmp_path / "nowhere"
    assert main(["train", "--resume", str(out), "--config", TINY, "--no-progress"]) == 2
    assert "not a run folder" in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize(
    "override, expected",
    [
        ('output_dir="runs/o3', "not a valid TOML value"),
        ("grpo.beta=[0.1", "not a valid TOML value"),
    ],
)
def test_set_values_that_start_like_toml_must_parse(
    tmp_path, monkeypatch, capsys, override, expected
):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--config", TINY, "--set", override, "--no-progress"]) == 2
    assert expected in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # no folder named '"runs'


@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
def test_non_finite_numbers_are_refused_with_their_path(value):
    with pytest.raises(
        ConfigError,
        match=rf"\$\.grpo\.temperature: {value.lstrip('-')}|"
        rf"\$\.grpo\.temperature: -inf",
    ):
        load_config(TINY, [f"grpo.temperature={value}"])


def test_an_unknown_tokenizer_names_the_policy_field(tmp_path, capsys):
    assert train(tmp_path / "run", "--set", 'policies.1.tokenizer="nope"') == 2
    assert "policies.qwen-deepseek.tokenizer: tokenizer 'nope'" in capsys.readouterr().err


def test_a_peer_log_of_a_newer_protocol_is_a_named_error(tmp_path, capsys):
    import msgspec

    from mutualrl.exchange import Envelope
    from mutualrl.exchange.codec import RecordCodec
    from mutualrl.exchange.framing import encode_frame, make_compressor

    peer = tmp_path / "newer"
    (peer / "experience").mkdir(parents=True)
    env = Envelope(
        schema_version=(9, 0),
        kind="rollout",
        producer="a",
        producer_version=0,
        seq=0,
        payload=msgspec.Raw(msgspec.msgpack.encode({})),
    )
    (peer / "experience" / "0-1.mrlx").write_bytes(
        encode_frame(RecordCodec().encode_batch([env]), make_compressor())
    )
    assert train(tmp_path / "run", "--set", 'strategy="prp"', "--peer-log", str(peer)) == 2
    err = capsys.readouterr().err
    assert f"exchange.peer_logs (--peer-log): {peer} cannot be replayed" in err and "MAJOR 9" in err
    assert "Traceback" not in err


def test_overwrite_deletes_the_failures_of_the_run_it_replaces(tmp_path):
    """``failures.jsonl`` is a run file: a fresh run refuses a folder that holds one, and
    ``--overwrite`` deletes it (the new run would append to the old run's failures)."""
    from mutualrl.run.folder import holds_a_run

    (tmp_path / LOCK_FILE).write_text("pid 1: mutualrl train\n")  # a run's note: it wrote here
    (tmp_path / "failures.jsonl").write_text('{"policy": "a"}\n')
    assert holds_a_run(tmp_path) == ["failures.jsonl"]
    with pytest.raises(ConfigError, match="already holds a run"):
        claim(tmp_path)
    claim(tmp_path, overwrite=True).release()
    assert not (tmp_path / "failures.jsonl").exists()


def test_a_plan_with_generators_apart_is_refused_by_train_before_anything_is_written(
    tmp_path, capsys
):
    out = tmp_path / "run"
    assert train(out, "--set", "allocation.colocate=false") == 2
    err = capsys.readouterr().err
    assert "allocation.colocate = false: mutualrl train runs each policy's generator" in err
    assert not out.exists() or not any(out.iterdir())


def test_resume_and_overwrite_together_are_refused(tmp_path, capsys):
    assert main(["train", "--resume", str(tmp_path), "--overwrite", "--no-progress"]) == 2
    assert (
        "--resume continues RUN_DIR and --overwrite deletes a run first" in capsys.readouterr().err
    )
