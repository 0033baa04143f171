"""The real models' cache on a real full disk, and a real converted folder tampered with.

Marked ``real_models`` (CI's real-models step): ``mutualrl models fetch`` into a cache on a 300 MB
tmpfs, where SmolLM2's conversion needs ~540 MB, is refused before it writes anything, in one
line; a converted folder whose config.json was edited is converted again on the next load by
path, as a resumed run loads it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mutualrl.config import PolicyConfig
from mutualrl.policies.model_cache import folder_problem, resolve_policies
from tests.tmpfs import mounted_tmpfs

pytestmark = pytest.mark.real_models


@pytest.fixture
def small_cache(tmp_path):
    mnt = tmp_path / "fs"
    with mounted_tmpfs(mnt, "300m"):
        yield mnt


def test_a_cache_too_small_for_the_conversion_is_one_line_before_any_write(small_cache):
    pytest.importorskip("gguf")
    done = subprocess.run(
        [sys.executable, "-m", "mutualrl.cli", "models", "fetch", "smollm2-135m-instruct"]
        + ["--no-install", "--no-progress"],
        capture_output=True,
        text=True,
        env={**os.environ, "MUTUALRL_CACHE": str(small_cache)},
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith(
        "mutualrl: error: packaged model 'smollm2-135m-instruct': no space left on device "
        f"converting it into {small_cache / 'models'}: it needs about 605 MB, "
    )
    assert "MUTUALRL_CACHE" in lines[0]
    assert [p.name for p in (small_cache / "models").iterdir()] == [".smollm2-135m-instruct.lock"]


def test_a_tampered_real_folder_is_converted_again_when_loaded_by_path(converted, capsys):
    folder, _ = converted["smollm2-135m-instruct"]
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 0.5}))
    p = PolicyConfig(name="a", checkpoint=str(folder), tokenizer=str(folder))
    assert resolve_policies([p])[0].checkpoint == str(folder)
    assert "config.json does not match its manifest hash); converting it again" in (
        capsys.readouterr().err
    )
    assert folder_problem(folder) is None
    assert json.loads((folder / "config.json").read_text())["rms_norm_eps"] != 0.5


def test_a_resume_reverifies_the_real_cache_and_trains_on_the_rebuilt_folder(converted, tmp_path):
    """Train SmolLM2 by name, swap two token ids in its cached tokenizer.json, resume: the resume
    names the file that failed its manifest hash, converts the folder again and trains on it."""
    folder, _ = converted["smollm2-135m-instruct"]
    run = tmp_path / "run"
    (tmp_path / "run.toml").write_text(
        f"""
seed = 0
steps = 2
save_steps = 2   # one checkpoint of a real model and its optimizer (1.6 GB), to resume from
save_total_limit = 1
strategy = "none"
output_dir = "{run}"
torch_threads = 2
[grpo]
num_generations = 2
prompts_per_step = 1
max_completion_length = 4
[warmup]
max_steps = 0
[eval]
every = 0
num_prompts = 1
[task]
name = "arithmetic"
[[policies]]
name = "smol"
checkpoint = "smollm2-135m-instruct"
chat_template = true
"""
    )
    env = {**os.environ, "MUTUALRL_CACHE": os.environ["MUTUALRL_CACHE"]}
    cli = [sys.executable, "-m", "mutualrl.cli", "train", "--no-progress"]
    first = subprocess.run(
        [*cli, "--config", str(tmp_path / "run.toml")], capture_output=True, text=True, env=env,
        timeout=600,
    )  # fmt: skip
    assert first.returncode == 0, first.stderr
    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["1"], vocab["2"] = vocab["2"], vocab["1"]
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    assert folder_problem(folder) is not None
    resumed = subprocess.run(
        [*cli, "--resume", str(run), "--steps", "3"], capture_output=True, text=True, env=env,
        timeout=600,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert "tokenizer.json does not match its manifest hash); converting it again" in (
        resumed.stderr
    )
    assert folder_problem(folder) is None
    restored = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    assert restored["1"] < restored["2"]  # the swap is gone (digits are in order in SmolLM2)
    steps = [
        json.loads(line)["step"]
        for line in (run / "metrics.jsonl").read_text().splitlines()
        if json.loads(line).get("phase") == "train"
    ]
    assert steps == [0, 1, 2]
