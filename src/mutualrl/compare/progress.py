"""The compare's display: runs done / total, the current run's phases, an ETA."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mutualrl.run.progress import RunProgress

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID


class CompareProgress:
    """One rich display: runs done / total and the current run's phase (warm start, train)."""

    def __init__(self, enabled: bool = True, console=None, jobs: int = 1) -> None:
        self.enabled = enabled
        self.jobs = max(1, jobs)  # runs at a time: the ETA divides the work among them
        self.console = console  # finished runs are reported here even without a display
        self._progress: Progress | None = None
        self._overall: TaskID | None = None  # the runs' bar, once ``start`` added it
        self._remaining = 0
        self._walls: list[float] = []  # wall seconds of the runs finished in this session
        if enabled:
            from mutualrl.run.progress import make_progress

            self._progress = make_progress(console)

    def __enter__(self) -> CompareProgress:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()

    def start(self, total: int, done: int) -> None:
        self._remaining = total - done
        if self._progress is not None:
            self._overall = self._progress.add_task("", total=total, completed=done, phase="runs")

    def run_started(self, name: str) -> RunProgress:
        if self._progress is None or self._overall is None:
            return RunProgress(enabled=False)
        eta = self.eta()
        self._progress.update(
            self._overall, description=f"running {name}" + (f"; {eta}" if eta else "")
        )
        return _NestedRunProgress(self._progress) if self.jobs == 1 else RunProgress(enabled=False)

    def note(self, line: str) -> None:
        """A message for the user (e.g. a damaged checkpoint that is skipped)."""
        if self._progress is not None:
            self._progress.console.print(line)
        elif self.console is not None:
            self.console.print(line)

    def eta(self) -> str:
        """Time left, estimated from the runs finished so far (a seed's first run also pays the
        warm start, so early estimates run a little high)."""
        if not self._walls or self._remaining <= 0:
            return ""
        left = (
            sum(self._walls) / len(self._walls) * self._remaining / min(self.jobs, self._remaining)
        )
        return f"ETA {int(left // 60)}m{int(left % 60):02d}s (from {len(self._walls)} finished)"

    def run_finished(
        self, name: str, line: str, wall_s: float | None = None, extra: str = ""
    ) -> None:
        self._remaining -= 1
        if wall_s is not None:
            self._walls.append(wall_s)
        eta = self.eta()
        line = (f"{line}; {eta}" if eta else line) + extra
        if self._progress is not None:
            if self._overall is not None:
                self._progress.update(
                    self._overall,
                    advance=1,
                    description=f"finished {name}" + (f"; {eta}" if eta else ""),
                )
            self._progress.console.print(line)
        elif self.console is not None:
            self.console.print(line)


class _NestedRunProgress(RunProgress):
    """A run's phases as rows of the compare's display; a phase's row goes when the next starts."""

    def __init__(self, progress) -> None:
        super().__init__(enabled=False)
        self._shared = progress
        self._row = None

    def start_phase(self, phase: str, total: int, completed: int = 0) -> None:
        self._drop_row()
        self._row = self._shared.add_task("", total=total, completed=completed, phase=f"  {phase}")

    def advance(self, description: str = "") -> None:
        if self._row is not None:
            self._shared.update(self._row, advance=1, description=description)

    def finish_phase(self, message: str) -> None:
        if self._row is not None:
            from mutualrl.run.progress import finish_task

            finish_task(self._shared, self._row, message)

    def _drop_row(self) -> None:
        if self._row is not None:
            self._shared.remove_task(self._row)
            self._row = None

    def close(self) -> None:
        self._drop_row()
