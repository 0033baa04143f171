"""The benchmark scripts still run against the code they measure: each at its smallest size, in
a subprocess as a user runs it, with the JSON it writes checked for what its tables quote.
(Their figures are taken by running them in full; see docs/results/performance.md.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str, out: Path) -> dict:
    cmd = [sys.executable, str(ROOT / "benchmarks" / script), *args]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_bench_floor_steps_both_sides_to_the_same_loss(tmp_path):
    out = tmp_path / "floor.json"
    got = _run("bench_floor.py", "--json", str(out), "--steps", "2", "--threads", "1",
               "--prompts", "2", "--generations", "2", "--tokens", "4", out=out)
    assert set(got["ratio_mutualrl_over_bare"]) >= {"generate", "update", "step"}
    assert got["max_abs_diff"]["loss"] < 1e-5 and got["max_abs_diff"]["grad_norm"] < 1e-5


def test_sim_paced_drives_run_paced_with_simulated_steps(tmp_path):
    out = tmp_path / "sim.json"
    got = _run("sim_paced.py", "--workers", "2", "--k", "0", "1", "--steps", "4",
               "--scale", "0.001", "--json", str(out), out=out)
    assert {(r["workers"], r["k"]) for r in got["rows"]} == {(2, 0), (2, 1)}
    assert all(r["stale_dropped"] == 0 for r in got["rows"])


def test_bench_grpo_step_times_both_trainers(tmp_path):
    pytest.importorskip("trl")
    out = tmp_path / "step.json"
    got = _run("bench_grpo_step.py", "--steps", "1", "--prompts", "2", "--generations", "2",
               "--max-completion-length", "4", "--json", str(out), out=out)
    for side in ("ours_step_s", "trl_step_s"):
        assert got[side]["n"] == 1 and got[side]["median"] > 0, got[side]
