"""Kill a run with SIGKILL in the middle of a step, resume it, and get the uninterrupted run back.

The CPU default (configs/default.toml), shortened, runs in subprocesses exactly as a user runs it.
Every per-step metric from the checkpoint on must equal an uninterrupted run's (timing aside), and
the experience log must replay record for record: no damaged frame, no duplicate, no gap.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mutualrl.exchange import read_log
from mutualrl.exchange.framing import ReadStats
from mutualrl.run.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "configs" / "default.toml"
TIMING = ("time_s", "tokens_per_s", "step_time_s")


def shortened(out: Path, cache: Path, *extra: str) -> list[str]:
    sets = [
        "save_steps=2",
        "warmup.max_steps=30",
        "eval.every=2",
        "eval.num_prompts=2",
        "eval.k=1",
        "torch_threads=1",
        f'warmup.cache_dir="{cache}"',
        *extra,
    ]
    return [
        sys.executable,
        "-m",
        "mutualrl.cli",
        "train",
        "--config",
        str(DEFAULT),
        "--steps",
        "5",
        "--no-progress",
        "--output-dir",
        str(out),
        *(a for s in sets for a in ("--set", s)),
    ]


def run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]


def train_rows(out: Path) -> int:
    path = out / "metrics.jsonl"
    return path.read_text().count('"phase": "train"') if path.exists() else 0


def kill_mid_step(cmd: list[str], out: Path, after_rows: int) -> None:
    """Start the run and SIGKILL it while it trains the step after ``after_rows`` logged steps."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT, start_new_session=True
    )
    deadline = time.monotonic() + 600
    while train_rows(out) < after_rows:
        assert proc.poll() is None, "the run ended before it could be interrupted"
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def per_step(out: Path, first_step: int) -> list[dict]:
    return [
        {k: v for k, v in r.items() if not k.endswith(TIMING)}
        for r in read_metrics(out / "metrics.jsonl")
        if r["phase"] in ("train", "eval") and r["step"] >= first_step
    ]


def replay(out: Path) -> list[tuple]:
    stats = ReadStats()
    records = [(d.kind, d.producer, d.seq, d.record) for d in read_log(out, stats=stats)]
    assert stats.skipped == 0, f"damaged frames or records in {out}/experience"
    return records


@pytest.mark.parametrize("local_mode", ["threads", "sequential"])
def test_sigkill_mid_step_then_resume_equals_uninterrupted(
    uninterrupted_default, tmp_path, local_mode
):
    reference, cache, _ = uninterrupted_default  # conftest.py: the same command, not killed
    out = tmp_path / f"killed-{local_mode}"
    cmd = shortened(out, cache, f'allocation.local_mode="{local_mode}"')
    kill_mid_step(cmd, out, after_rows=3)  # checkpoint at step 2; step 4 was running
    assert train_rows(out) == 3
    run([sys.executable, "-m", "mutualrl.cli", "train", "--resume", str(out), "--no-progress"])

    records = read_metrics(out / "metrics.jsonl")
    resumed = [r for r in records if r["phase"] == "resume"]
    assert [r["step"] for r in resumed] == [2]
    assert per_step(out, 2) == per_step(reference, 2)
    assert [r["step"] for r in records if r["phase"] == "train"] == [0, 1, 2, 3, 4]
    # the killed run's row of step 2 moved aside, not lost
    assert '"step": 2' in (out / "metrics.discarded.jsonl").read_text()

    log = replay(out)
    assert log == replay(reference)  # record for record, sequence numbers included
    by_producer: dict[str, list[int]] = {}
    for _, producer, seq, _ in log:
        by_producer.setdefault(producer, []).append(seq)
    for producer, seqs in by_producer.items():
        assert seqs == list(range(len(seqs))), f"{producer}: gap or duplicate in sequence numbers"
