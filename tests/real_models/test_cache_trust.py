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
