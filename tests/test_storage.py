"""A full disk tears nothing and says so: whole-record appends, complete-or-absent folders.

The end-to-end case runs the tiny config on a real tmpfs too small for its second checkpoint
(mounting one needs root; elsewhere it is skipped and the simulated cases below still run): the
run stops with one message naming the file and "no space left on device", every record written
before is whole, and after the filesystem grows ``--resume`` finishes the run.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from mutualrl.exchange import ExperienceLog
from mutualrl.run.metrics import MetricsWriter, read_metrics
from mutualrl.storage import SCRATCH_LOCK, ScratchFolder, StorageError, atomic_folder
from tests.tmpfs import mounted_tmpfs

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.toml")


def failing_write(after_bytes: int):
    """An ``os.write`` that writes ``after_bytes`` in all, then fails with ENOSPC."""
    real, budget = os.write, [after_bytes]

    def write(fd, data):
        if budget[0] <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        n = real(fd, bytes(data[: budget[0]]))
        budget[0] -= n
        return n

    return write


def test_a_metrics_record_is_whole_or_absent_on_a_full_disk(tmp_path, monkeypatch):
    w = MetricsWriter(tmp_path / "metrics.jsonl")
    w.write({"phase": "train", "step": 0, "x": 1.0})
    before = (tmp_path / "metrics.jsonl").read_bytes()
    monkeypatch.setattr(os, "write", failing_write(10))  # the next record tears after 10 bytes
    with pytest.raises(
        StorageError,
        match="metrics.jsonl: no space left on device; this record "
        r"\(train step 1\) was not written",
    ):
        w.write({"phase": "train", "step": 1, "x": 2.0})
    monkeypatch.undo()
    assert (tmp_path / "metrics.jsonl").read_bytes() == before  # cut back: no torn line
    w.write({"phase": "train", "step": 1, "x": 2.0})  # and it goes on afterwards
    w.close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1]


def test_an_experience_frame_is_whole_or_absent_on_a_full_disk(tmp_path, monkeypatch):
    import msgspec

    from mutualrl.exchange import Envelope

    log = ExperienceLog(tmp_path, batch_records=1)
    env = Envelope(
        schema_version=(1, 0),
        kind="watermark",
        producer="p",
        producer_version=0,
        seq=0,
        payload=msgspec.Raw(msgspec.msgpack.encode({"producer": "p", "version": 0})),
    )
    log.append(env)
    size = log.path.stat().st_size
    monkeypatch.setattr(os, "write", failing_write(7))
    with pytest.raises(StorageError, match="no space left on device; a frame of 1 records"):
        log.append(env)
    monkeypatch.undo()
    assert log.path.stat().st_size == size


def test_a_folder_is_complete_or_absent(tmp_path):
    final = tmp_path / "policies" / "p"
    with pytest.raises(StorageError, match="no space left on device; policy 'p' was not written"):
        with atomic_folder(final, "policy 'p'") as tmp:
            (tmp / "config.json").write_text("{}")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert not final.exists() and list(final.parent.iterdir()) == []
    with atomic_folder(final, "policy 'p'") as tmp:
        (tmp / "config.json").write_text("{}")
    assert (final / "config.json").is_file() and len(list(final.parent.iterdir())) == 1


def test_an_error_that_is_not_about_space_passes_through(tmp_path):
    with pytest.raises(ValueError, match="not about space"):
        with atomic_folder(tmp_path / "f", "f"):
            raise ValueError("not about space")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def small_fs(tmp_path):
    """A tmpfs of its own (root only); yields (mount point, resize function)."""
    mnt = tmp_path / f"fs-{uuid.uuid4().hex[:6]}"
    with mounted_tmpfs(mnt, "110m") as resize:
        yield mnt, resize


def test_a_run_on_a_full_disk_stops_with_one_message_and_resumes_after_space_is_freed(small_fs):
    mnt, resize = small_fs
    out = mnt / "run"
    cmd = [
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
        "4",
        "--set",
        "save_steps=1",
    ]
    full = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert full.returncode == 1, full.stderr[-3000:]
    assert "no space left on device" in full.stderr and "Traceback" not in full.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]  # whole
    checkpoints = sorted((out / "checkpoints").glob("step-*"))
    assert checkpoints and all((c / "manifest.json").is_file() for c in checkpoints)
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]
    assert not (out / "policies").exists() or all(
        any(p.glob("*.safetensors")) for p in (out / "policies").iterdir()
    )
    resize("1g")
    resumed = subprocess.run(
        [sys.executable, "-m", "mutualrl.cli", "train", "--resume", str(out), "--no-progress"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl") if r["phase"] == "train"]
    assert steps == [0, 1, 2, 3] and len(rows) >= 1


# ---- scratch folders ---------------------------------------------------------------------------
OWNER = """
import sys, time
from mutualrl.storage import ScratchFolder
s = ScratchFolder("mutualrl-p-", sys.argv[1])
(s.path / "weights").write_bytes(b"x" * 1000)
print(s.path, flush=True)
time.sleep(600)
"""


def test_a_scratch_folder_is_removed_when_closed_or_collected(tmp_path):
    s = ScratchFolder("mutualrl-p-", tmp_path)
    assert s.path.parent == tmp_path and s.path.name.startswith("mutualrl-p-")
    s.cleanup()
    s.cleanup()
    assert list(tmp_path.iterdir()) == []
    path = ScratchFolder("mutualrl-p-", tmp_path).path  # collected at once
    assert not path.exists()


def test_a_killed_owners_scratch_folder_goes_with_the_next_one_and_a_live_owners_stays(tmp_path):
    """SIGKILL runs no clean-up: the folder stays until the next scratch folder made beside it
    finds its lock free. Another process's folder in use is left alone."""

    def owner():
        p = subprocess.Popen(
            [sys.executable, "-c", OWNER, str(tmp_path)], stdout=subprocess.PIPE, text=True
        )
        return p, Path(p.stdout.readline().strip())

    (killed, gone), (alive, kept) = owner(), owner()
    (tmp_path / "mutualrl-other").mkdir()  # not a scratch folder: never touched
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert (gone / "weights").is_file()
    try:
        s = ScratchFolder("mutualrl-p-", tmp_path)
        assert s.swept == [gone] and not gone.exists()
        assert (kept / "weights").is_file() and (tmp_path / "mutualrl-other").is_dir()
        s.cleanup()
    finally:
        alive.kill()
        alive.wait()


def _killed_at_op(k: int, parent: Path) -> int:
    """A forked process makes a scratch folder (files, a sub-folder) and is killed (``_exit``)
    as it starts its ``k``-th unlink, rmdir or rename of the clean-up; its exit status: 9 when
    killed, 0 when the clean-up ended first."""
    pid = os.fork()
    if pid == 0:
        try:
            s = ScratchFolder("mutualrl-p-", parent)
            for name in ("config.json", "model.safetensors", "sub/tokenizer.json"):
                (s.path / name).parent.mkdir(exist_ok=True)
                (s.path / name).write_bytes(b"x" * 100)
            ops = [0]

            def dying(real):
                def op(*args, **kwargs):
                    if ops[0] == k:
                        os._exit(9)
                    ops[0] += 1
                    return real(*args, **kwargs)

                return op

            os.unlink, os.rmdir, os.rename = map(dying, (os.unlink, os.rmdir, os.rename))
            s.cleanup()
            os._exit(0)
        finally:
            os._exit(1)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_a_scratch_folder_killed_at_any_point_of_its_removal_goes_with_the_next_sweep(tmp_path):
    """The clean-up killed before each of its file operations in turn: what it leaves, a
    renamed folder with its lock file or an empty one, is removed by the next scratch folder
    made beside it (a folder whose lock file went first would never be)."""
    killed = 0
    for k in range(20):
        code = _killed_at_op(k, tmp_path)
        assert code in (0, 9), code
        if code == 0:
            break
        killed += 1
        s = ScratchFolder("mutualrl-p-", tmp_path)
        assert [p.name for p in tmp_path.iterdir()] == [s.path.name], (k, list(tmp_path.iterdir()))
        s.cleanup()
        assert list(tmp_path.iterdir()) == []
    assert killed >= 6 and list(tmp_path.iterdir()) == []


def test_a_scratch_folder_that_cannot_be_renamed_is_removed_where_it_is_lock_file_last(
    tmp_path, monkeypatch
):
    s = ScratchFolder("mutualrl-p-", tmp_path)
    (s.path / "sub").mkdir()
    for name in ("config.json", "sub/tokenizer.json", "weights"):
        (s.path / name).write_bytes(b"x")
    unlinked, unlink = [], os.unlink

    def refuse(src, dst):
        raise PermissionError(13, "Permission denied", str(src))

    def record(path, *args, **kwargs):
        unlinked.append(Path(path).name)
        return unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "rename", refuse)
    monkeypatch.setattr(os, "unlink", record)
    s.cleanup()
    assert list(tmp_path.iterdir()) == []
    assert unlinked[-1] == SCRATCH_LOCK
    assert set(unlinked) >= {"config.json", "weights", SCRATCH_LOCK}
