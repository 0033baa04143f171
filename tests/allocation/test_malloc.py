"""The allocator set-up every mutualrl process applies at start-up (malloc.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CODE = "from mutualrl.malloc import reuse_large_buffers as r; print(r()); print(r())"


def _mode(**env) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", CODE],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **env},
        timeout=120,
    )
    return out.stdout.split()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_large_buffers_are_reused_unless_asked_for_the_system_allocator():
    assert _mode(MUTUALRL_MALLOC="reuse") == ["reuse", "reuse"]  # once per process
    assert _mode(MUTUALRL_MALLOC="system") == ["system", "system"]


def test_a_preloaded_caching_allocator_is_left_alone(monkeypatch):
    import mutualrl.malloc as m

    monkeypatch.setattr(m, "_state", {})
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")
    monkeypatch.delenv("MUTUALRL_MALLOC", raising=False)
    assert m.reuse_large_buffers() == "preloaded: jemalloc"


def test_only_the_commands_that_train_set_the_allocator_up_for_large_buffers():
    # one arena slows the Rust tokenizers' thread pool (malloc.py): the retokenization
    # benchmark, plan and exchange inspect keep glibc's defaults
    from mutualrl.cli import build_parser

    parser = build_parser()
    trains = {
        cmd: parser.parse_args(argv).trains
        for cmd, argv in {
            "train": ["train", "--config", "configs/tiny.toml"],
            "compare": ["compare", "--config", "configs/tiny.toml"],
            "bench retokenize": ["bench", "retokenize"],
            "plan": ["plan", "--config", "configs/tiny.toml"],
            "exchange inspect": ["exchange", "inspect", "runs/x"],
        }.items()
    }
    assert trains == {
        "train": True,
        "compare": True,
        "bench retokenize": False,
        "plan": False,
        "exchange inspect": False,
    }
