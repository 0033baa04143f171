"""Sharded learners killed and resumed on another rank count, in subprocesses as a user runs them.

The tiny config under SGT, both policies' learners on 2 ranks (four rank processes, gloo, the
process executor): SIGKILLed after its fourth step's row with a DCP checkpoint after step 2;
resumed on one rank each (the local executor), which re-takes step 3 from the sharded checkpoint
and checkpoints again (one-rank format); resumed once more on 2 ranks each from that checkpoint.
2 -> 1: the re-taken step equals the killed run's record of it up to float rounding (the same
samples and rewards: the weights came back exactly). 1 -> 2: the final evaluation equals the one
the one-rank run made from the same state, exactly (rank 0's copy holds the same weights).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mutualrl.run.metrics import read_metrics

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"
TIMING = ("time_s", "tokens_per_s", "step_time_s")
RANKS = ("policies.0.learner_ranks", "policies.1.learner_ranks")


def train(out: Path, *sets: str, resume: bool = False) -> list[str]:
    head = ["--resume", str(out)] if resume else ["--config", str(TINY), "--output-dir", str(out)]
    return [
        sys.executable,
        "-m",
        "mutualrl.cli",
        "train",
        "--no-progress",
        *head,
        *(a for s in sets for a in ("--set", s)),
    ]


def ranks(n: int) -> list[str]:
    executor = '"process"' if n > 1 else '"local"'
    return [f"allocation.executor={executor}", *(f"{k}={n}" for k in RANKS)]


def run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]


def rows(path: Path, phase: str) -> list[dict]:
    return (
        [
            {k: v for k, v in r.items() if not k.endswith(TIMING) and "shard_probe_gap" not in k}
            for r in read_metrics(path)
            if r["phase"] == phase
        ]
        if path.exists()
        else []
    )


def kill_after_rows(cmd: list[str], out: Path, n: int) -> list[int]:
    """Start the run, SIGKILL its whole process group once ``n`` train rows are logged; the pids
    of the run and its worker processes at that moment."""
    psutil = pytest.importorskip("psutil")
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT, start_new_session=True
    )
    deadline = time.monotonic() + 600
    while len(rows(out / "metrics.jsonl", "train")) < n:
        assert proc.poll() is None, "the run ended before it could be interrupted"
        assert time.monotonic() < deadline
        time.sleep(0.02)
    members = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return members


def test_sigkill_then_resume_from_2_ranks_on_1_and_back(tmp_path):
    psutil = pytest.importorskip("psutil")
    out = tmp_path / "run"
    common = (
        'strategy="sgt"',
        "steps=4",
        "save_steps=2",
        "torch_threads=1",
        "allocation.inventory.cpus_per_node=2",
        "allocation.call_timeout_s=300",
    )
    members = kill_after_rows(train(out, *common, *ranks(2)), out, 3)
    assert len(members) >= 5  # the driver and four rank processes
    # The rank processes lead process groups of their own (workers.processes), which their
    # guards kill once the driver is gone: 0.1-1.2 s in five tries, 15 s allowed when busy.
    deadline = time.monotonic() + 15
    while [
        p
        for p in members
        if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
    ]:
        assert time.monotonic() < deadline, "a process survived"
        time.sleep(0.1)
    ckpt = out / "checkpoints" / "step-000002" / "policies"
    assert all(
        (ckpt / n / "dcp" / ".metadata").is_file() for n in ("llama-mistral", "qwen-deepseek")
    )
    killed_step = rows(out / "metrics.jsonl", "train")[2]

    run(train(out, *ranks(1), resume=True))  # 2 -> 1 from the DCP checkpoint
    resumed = rows(out / "metrics.discarded.jsonl", "train")
    assert [r["step"] for r in resumed] == [2]  # the killed run's row of step 3, moved aside
    again = rows(out / "metrics.jsonl", "train")
    assert [r["step"] for r in again] == [0, 1, 2, 3]
    for k, v in killed_step.items():
        if isinstance(v, float):
            assert again[2][k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
        else:
            assert again[2][k] == v, k  # samples, rewards, counts: the same
    assert (
        out / "checkpoints" / "step-000004" / "policies" / "llama-mistral" / "state.pt"
    ).is_file()
    one_rank_eval = rows(out / "metrics.jsonl", "eval")[-1]

    run(train(out, *ranks(2), resume=True))  # 1 -> 2 from the one-rank checkpoint
    resume = rows(out / "metrics.jsonl", "resume")
    assert resume[-1]["step"] == 4 and sorted(resume[-1]["changed_harmless"]) == [
        "allocation.executor",
        *RANKS,
    ]
    assert rows(out / "metrics.jsonl", "eval")[-1] == one_rank_eval
    assert [r["step"] for r in rows(out / "metrics.jsonl", "train")] == [0, 1, 2, 3]
    for name in ("llama-mistral", "qwen-deepseek"):
        assert (out / "policies" / name / "model.safetensors").is_file()
    assert json.loads((out / "config.json").read_text())["policies"][0]["learner_ranks"] == 2
