"""Signals, torn and short files, a dead compare: each stops cleanly and loses nothing.

Runs are real ``mutualrl`` processes on the tiny config. Each case was a defect: SIGINT aborted
mid-step (exit 134) and named the wrong resume command, SIGTERM wrote nothing, resume accepted a
metrics file shorter than its checkpoint and glued its row onto a torn line, a killed compare's
workers trained on.
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

from mutualrl.run.signals import RunInterrupted, StopRequests

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.toml")


def train_cmd(out: Path, steps: int = 30, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "mutualrl.cli",
        "train",
        "--config",
        TINY,
        "--output-dir",
        str(out),
        "--no-progress",
        "--steps",
        str(steps),
        "--set",
        "save_steps=1",
        *extra,
    ]


def train_rows(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [
        r["step"] for r in map(json.loads, path.read_text().splitlines()) if r["phase"] == "train"
    ]


def wait_for(cond, proc: subprocess.Popen | None = None, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if proc is not None and proc.poll() is not None:  # say why: CI shows only this
            _, err = proc.communicate()
            raise AssertionError(
                f"the process ended first, with exit code {proc.returncode}:\n{(err or '')[-3000:]}"
            )
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def start(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_stops_at_a_step_boundary_with_a_checkpoint_and_the_resume_command(
    tmp_path, sig, code
):
    out = tmp_path / "run"
    proc = start(train_cmd(out, 12))  # far from its end when the signal comes after step 2
    wait_for(lambda: len(train_rows(out)) >= 2, proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == code, err[-2000:]
    assert f"mutualrl train --resume {out}" in err and "Traceback" not in err
    done = train_rows(out)
    assert done == list(range(len(done)))  # whole steps only, none half-logged
    assert (out / "checkpoints" / f"step-{len(done):06d}" / "manifest.json").is_file()
    resumed = subprocess.run(
        [sys.executable, "-m", "mutualrl.cli", "train", "--resume", str(out), "--no-progress"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resuming from {out / 'checkpoints'}" in resumed.stderr
    assert train_rows(out) == list(range(12))


def test_ctrl_c_at_the_terminal_stops_a_run_of_worker_processes_at_a_step_boundary(tmp_path):
    """A terminal sends Ctrl-C to its whole foreground process group. Worker processes lead
    groups of their own, so only the driver gets it and the step in flight finishes."""
    out = tmp_path / "run"
    proc = subprocess.Popen(
        train_cmd(out, 30, "--set", 'allocation.executor="process"'),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    wait_for(lambda: len(train_rows(out)) >= 2, proc)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-2000:]
    assert f"mutualrl train --resume {out}" in err and "Traceback" not in err
    done = train_rows(out)
    assert done == list(range(len(done)))
    assert (out / "checkpoints" / f"step-{len(done):06d}" / "manifest.json").is_file()


def test_the_same_signal_twice_stops_at_once_and_another_kind_does_not(monkeypatch):
    exits = []
    monkeypatch.setattr(os, "_exit", exits.append)
    stop = StopRequests()
    stop._handle(signal.SIGINT, None)
    stop._handle(signal.SIGTERM, None)  # a compare passing SIGTERM on: the same request
    assert stop.signum == signal.SIGINT and exits == []
    stop._handle(signal.SIGINT, None)  # Ctrl-C again
    assert exits == [130]


def test_run_interrupted_survives_pickling_across_processes(tmp_path):
    import pickle

    exc = pickle.loads(pickle.dumps(RunInterrupted(signal.SIGTERM, 3, tmp_path, tmp_path / "c")))
    assert (exc.step, exc.exit_code) == (3, 143) and str(tmp_path) in str(exc)


@pytest.fixture(scope="module")
def stopped_run(module_tmp) -> Path:
    """A tiny run stopped by SIGTERM after a few steps, with a checkpoint per step."""
    out = module_tmp("stopped") / "run"
    proc = start(train_cmd(out, 10))
    wait_for(lambda: len(train_rows(out)) >= 3, proc)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=300)
    assert proc.returncode == 143
    return out


def copy_run(src: Path, dst: Path) -> Path:
    subprocess.run(["cp", "-a", str(src), str(dst)], check=True)
    return dst


def resume(out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mutualrl.cli", "train", "--resume", str(out), "--no-progress"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_resume_refuses_a_metrics_file_shorter_than_its_checkpoint(stopped_run, tmp_path):
    out = copy_run(stopped_run, tmp_path / "cut")
    path = out / "metrics.jsonl"
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size // 2)  # cut mid-line, well before the checkpoint's length
    done = resume(out)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"{path} is {size // 2} bytes where the checkpoint recorded" in done.stderr
    assert path.stat().st_size == size // 2  # nothing glued on, nothing cut further


def test_resume_refuses_a_log_segment_cut_short(stopped_run, tmp_path):
    out = copy_run(stopped_run, tmp_path / "cut-log")
    seg = sorted((out / "experience").glob("*.mrlx"))[0]
    with open(seg, "r+b") as f:
        f.truncate(seg.stat().st_size // 3)
    done = resume(out)
    assert done.returncode == 2 and seg.name in done.stderr and "bytes" in done.stderr


def test_a_torn_tail_after_the_checkpoint_is_moved_aside_never_glued_onto(stopped_run, tmp_path):
    out = copy_run(stopped_run, tmp_path / "torn")
    with open(out / "metrics.jsonl", "ab") as f:
        f.write(b'{"phase": "train", "step": 99, "policy/x')  # a torn record, no newline
    done = resume(out)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["phase"] == "train"] == list(range(10))
    assert b'"step": 99, "policy/x' in (out / "metrics.discarded.jsonl").read_bytes()


def test_a_manifest_without_files_is_skipped_by_name(stopped_run, tmp_path):
    out = copy_run(stopped_run, tmp_path / "manifest")
    newest = sorted((out / "checkpoints").glob("step-*"))[-1]
    manifest = json.loads((newest / "manifest.json").read_text())
    del manifest["files"]
    (newest / "manifest.json").write_text(json.dumps(manifest))
    done = resume(out)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"checkpoint {newest} skipped: its manifest lists no files" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_killed_compare_leaves_no_worker_training(tmp_path):
    psutil = pytest.importorskip("psutil")
    out = tmp_path / "compare"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mutualrl.cli",
            "compare",
            "--config",
            TINY,
            "--strategies",
            "none,prp",
            "--seeds",
            "1",
            "--jobs",
            "2",
            "--steps",
            "200",
            "--output-dir",
            str(out),
            "--no-progress",
            "--set",
            "save_steps=1",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    runs = [out / "runs" / "none-seed0", out / "runs" / "prp-seed0"]
    wait_for(lambda: any(len(train_rows(r)) >= 1 for r in runs), proc)
    workers = psutil.Process(proc.pid).children(recursive=True)
    assert workers
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    _, alive = psutil.wait_procs(workers, timeout=120)
    # an exited worker whose parent is gone may stay a zombie until someone reaps it: it runs
    # nothing
    alive = [p for p in alive if _running(p, psutil)]
    for p in alive:
        p.kill()
    assert not alive, f"workers still running after their compare died: {[p.pid for p in alive]}"
    for r in runs:  # what a worker wrote after its parent died ended at a step boundary
        steps = train_rows(r)
        assert steps == list(range(len(steps)))


def _running(proc, psutil) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
