"""SIGINT and SIGTERM stop a run at a step boundary, never in the middle of one.

While a run trains, the first SIGINT or SIGTERM only asks it to stop: the step in flight finishes
(its workers are threads deep in torch; interrupting them there aborts the process), a checkpoint
is written when ``save_steps > 0``, and ``RunInterrupted`` carries the resume command up to the
command line, which prints it and exits 130 (SIGINT) or 143 (SIGTERM). The same signal again
stops at once: everything appended so far stays on disk, and ``--resume`` continues from the last
checkpoint.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class RunInterrupted(Exception):
    """The run stopped at a step boundary because a signal asked it to."""

    def __init__(self, signum: int, step: int, run_dir: Path, checkpoint: Path | None) -> None:
        self.signum, self.step, self.run_dir, self.checkpoint = signum, step, run_dir, checkpoint
        name = signal.Signals(signum).name
        if checkpoint is not None:
            how = (
                f"checkpoint at step {step} written; continue with: "
                f"mutualrl train --resume {run_dir}"
            )
        else:
            how = (
                "no checkpoint to resume from (save_steps = 0, or still warming up); start "
                "again with --overwrite, or set save_steps to make runs resumable"
            )
        after = f"GRPO step {step}" if step else "the warm start step"
        super().__init__(f"stopped by {name} after {after}; {how}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def __reduce__(self):  # crosses process boundaries (compare --jobs workers)
        return (RunInterrupted, (self.signum, self.step, self.run_dir, self.checkpoint))


class StopRequests:
    """Signal handlers for the life of a run (main thread only; elsewhere it never stops early)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._saved: dict[int, Any] = {}  # signal -> the handler it had

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                self._saved[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._saved.items():
            signal.signal(s, handler)
        self._saved.clear()

    def _handle(self, signum: int, frame) -> None:
        # The same signal again stops at once (Ctrl-C twice). Another kind is the same request:
        # a compare passes SIGTERM on to workers that the terminal's SIGINT already reached.
        if self.signum is not None and signum != self.signum:
            return
        if self.signum is not None:
            print(
                f"\nmutualrl: {signal.Signals(signum).name} again: stopping at once; resume "
                "from the last checkpoint with `mutualrl train --resume RUN_DIR`",
                file=sys.stderr,
                flush=True,
            )
            os._exit(128 + signum)
        self.signum = signum
        print(
            f"\nmutualrl: {signal.Signals(signum).name}: stopping after this step (again to "
            "stop at once)",
            file=sys.stderr,
            flush=True,
        )
