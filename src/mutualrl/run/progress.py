"""Progress display for long jobs (rich), silent when disabled (tests, non-terminals)."""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)


def make_progress(console: Console | None = None, transient: bool = False) -> Progress:
    """The project's progress layout: phase, bar, done/total, elapsed, live description."""
    return Progress(
        TextColumn("[bold]{task.fields[phase]}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        console=console or Console(stderr=True),
        transient=transient,
    )


class RunProgress:
    def __init__(self, enabled: bool = True, console: Console | None = None) -> None:
        self.enabled = enabled
        self._progress = None
        self._task: TaskID | None = None
        if enabled:
            self._progress = make_progress(console)

    def __enter__(self) -> RunProgress:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()

    def start_phase(self, phase: str, total: int, completed: int = 0) -> None:
        if self._progress is not None:
            self._task = self._progress.add_task("", total=total, completed=completed, phase=phase)

    def advance(self, description: str = "") -> None:
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, advance=1, description=description)

    def finish_phase(self, message: str) -> None:
        """Close the current phase's bar at its real end, saying why it ended."""
        if self._progress is not None and self._task is not None:
            finish_task(self._progress, self._task, message)
            self._task = None


def finish_task(progress: Progress, task_id, message: str) -> None:
    """Set the bar's total to what was done (a phase that ends early reads full, not cut off),
    stop its clock, and show ``message`` as its description."""
    done = progress.tasks[progress.task_ids.index(task_id)].completed
    progress.update(task_id, total=done, description=message)
    progress.stop_task(task_id)
