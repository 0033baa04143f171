"""The compare's ETA: time left estimated from the runs finished so far."""

from __future__ import annotations

import io

from rich.console import Console

from mutualrl.compare import CompareProgress


def test_eta_from_finished_runs_is_printed_with_each_run():
    buf = io.StringIO()
    p = CompareProgress(enabled=False, console=Console(file=buf, width=200))
    p.start(total=5, done=1)  # one run finished before (a resume): 4 to go
    assert p.eta() == ""
    p.run_finished("none-seed0", "  none-seed0: 60s", 60.0)
    p.run_finished("sgt-seed0", "  sgt-seed0: 100s", 100.0)
    assert p.eta() == "ETA 2m40s (from 2 finished)"  # 2 left x 80 s
    p.run_finished("a", "a", 80.0)
    p.run_finished("b", "b", 80.0)
    assert p.eta() == ""
    lines = buf.getvalue().splitlines()
    assert lines[0] == "  none-seed0: 60s; ETA 3m00s (from 1 finished)"
    assert lines[1] == "  sgt-seed0: 100s; ETA 2m40s (from 2 finished)"


def test_eta_with_jobs_divides_the_work_left_among_the_runs_at_a_time():
    p = CompareProgress(enabled=False, jobs=2)
    p.start(total=6, done=0)
    p.run_finished("a", "a", 60.0)
    p.run_finished("b", "b", 100.0)
    assert p.eta() == "ETA 2m40s (from 2 finished)"  # 4 left x 80 s / 2 at a time
    for name in "cde":
        p.run_finished(name, name, 80.0)
    assert p.eta() == "ETA 1m20s (from 5 finished)"  # the last run alone
