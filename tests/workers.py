"""Killing a worker process of a running ``mutualrl train``, as the OOM killer would (shared by
``test_restarts.py`` and ``real_vllm``)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def kill_one_worker_mid_run(
    cmd: list[str],
    log: Path,
    ready: Callable[[], bool],
    env: dict | None = None,
    wait_s: float = 1200,
) -> list:
    """Start ``cmd`` (a run of the process executor, two policies), SIGKILL the first of its
    worker processes once ``ready()``, and require the run to end with exit 0 (its output is in
    ``log``). Returns every process the run had started by then, to check none is left."""
    import psutil

    with open(log, "w") as fh:
        proc = subprocess.Popen(
            cmd, stdout=fh, stderr=fh, cwd=ROOT, start_new_session=True, env=env
        )
        try:
            deadline = time.monotonic() + 900
            while not ready():
                assert proc.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.05)
            started = psutil.Process(proc.pid).children(recursive=True)
            workers = [
                p
                for p in psutil.Process(proc.pid).children()
                if any("spawn" in part for part in p.cmdline())
            ]
            assert len(workers) == 2, [p.cmdline() for p in workers]  # one per policy
            os.kill(workers[0].pid, signal.SIGKILL)
            assert proc.wait(timeout=wait_s) == 0, log.read_text()[-3000:]
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    return started
