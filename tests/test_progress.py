"""Progress bars close at their phase's real end and say why it ended."""

from __future__ import annotations

import io
from types import SimpleNamespace

from rich.console import Console

from mutualrl.run.progress import RunProgress
from mutualrl.run.warmup import end_message


def test_finish_phase_sets_total_to_done_and_stops_the_clock():
    console = Console(file=io.StringIO(), force_terminal=False, width=120)
    with RunProgress(console=console) as progress:
        progress.start_phase("warm start", 200)
        for _ in range(50):
            progress.advance("acc 0.5")
        task = progress._progress.tasks[0]
        progress.finish_phase("target accuracy 0.9 reached at step 50")
        assert (task.completed, task.total, task.finished) == (50, 50, True)
        assert task.stop_time is not None and task.description.startswith("target accuracy 0.9")
        elapsed = task.elapsed
        assert task.elapsed == elapsed  # the clock no longer runs
        progress.advance("ignored")  # nothing to advance once the phase is finished
        assert task.completed == 50


def test_disabled_progress_finishes_quietly():
    progress = RunProgress(enabled=False)
    progress.start_phase("train", 3)
    progress.advance("step")
    progress.finish_phase("3 steps done")  # no display: nothing drawn, nothing raised
    assert progress._progress is None and progress._task is None


def test_warm_start_end_messages():
    w = SimpleNamespace(max_steps=200, target_accuracy=0.9)
    assert end_message(w, 50, [], True) == "target accuracy 0.9 reached at step 50"
    assert end_message(w, 200, ["qwen"], True) == (
        "max_steps 200 reached (qwen below target accuracy)"
    )
    assert end_message(w, 7, [], False) == "stopped at step 7: a policy failed"
