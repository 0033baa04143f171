"""Chaos: the shortened default SIGKILLed at seeded random moments, again and again, each time
continued as a user would (``--resume`` when a checkpoint exists, else started afresh with
``--overwrite``); in the end its metrics and experience log equal an uninterrupted run's and no
process of it is left.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_resume import ROOT, per_step, replay, run, shortened

pytestmark = pytest.mark.slow
KILLS = 3
SEED = 20261125


def checkpointed(out: Path) -> bool:
    return any((out / "checkpoints").glob("step-*/manifest.json"))


def attempt(out: Path, cache: Path) -> list[str]:
    if checkpointed(out):
        return [
            sys.executable,
            "-m",
            "mutualrl.cli",
            "train",
            "--resume",
            str(out),
            "--no-progress",
        ]
    return shortened(out, cache) + (["--overwrite"] if out.exists() else [])


def test_repeated_sigkill_then_resume_equals_an_uninterrupted_run(uninterrupted_default, tmp_path):
    psutil = pytest.importorskip("psutil")
    reference, cache, wall = uninterrupted_default  # conftest.py: the same command, not killed
    out, rng, killed = tmp_path / "chaos", random.Random(SEED), 0
    for _ in range(KILLS):
        cmd = attempt(out, cache)
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=ROOT,
            start_new_session=True,
        )
        time.sleep(rng.uniform(0.15, 0.6) * wall)  # a resumed attempt pays start-up again
        members = (
            [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
            if proc.poll() is None
            else []
        )
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            killed += 1
        proc.wait()
        assert not [
            p
            for p in members
            if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
        ], "a process survived"
    assert killed == KILLS  # every attempt was cut short, none ran to its end
    run(attempt(out, cache))
    assert per_step(out, 0) == per_step(reference, 0)
    assert replay(out) == replay(reference)
