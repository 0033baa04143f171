"""The append-only experience log of a run, and reading records back (replay).

On disk: ``RUN_DIR/experience/<time_ns>-<pid>.mrlx``, one segment per writer (a new one each
time a log is opened), each a sequence of frames (see ``framing``). Segments instead of one file
so that a writer that crashed mid-frame leaves its damage at the end of its own segment and
a resumed run never appends after garbage; replay reads segments in name (= time) order.

A frame is written with one ``os.write`` on an ``O_APPEND`` descriptor; a reader that still sees
a partial frame (a crash, or a reader racing the writer) flags it as truncated -- it never
returns a record from it.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections.abc import Collection, Iterator
from pathlib import Path

from mutualrl.exchange.codec import Delivery, Envelope, RecordCodec
from mutualrl.exchange.errors import ExchangeError
from mutualrl.exchange.framing import (
    DEFAULT_MAX_FRAME_BYTES,
    OnError,
    ReadStats,
    encode_frame,
    make_compressor,
)
from mutualrl.exchange.wire import iter_records
from mutualrl.storage import append_whole

LOG_DIRNAME = "experience"
SEGMENT_SUFFIX = ".mrlx"


class ExperienceLog:
    """Append-only, batched writer of envelopes under ``RUN_DIR/experience/``.

    Envelopes are buffered and written as one frame every ``batch_records`` records or
    ``batch_bytes`` payload bytes, and on ``flush``/``close``. Thread-safe.
    ``fsync=True`` also makes each frame durable before ``flush`` returns.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        batch_records: int = 256,
        batch_bytes: int = 4 << 20,
        level: int = 3,
        fsync: bool = False,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    ) -> None:
        if batch_records < 1 or batch_bytes < 1:
            raise ValueError(
                f"batch_records and batch_bytes must be >= 1, got {batch_records}, {batch_bytes}"
            )
        self.directory = Path(run_dir) / LOG_DIRNAME
        self.batch_records = batch_records
        self.batch_bytes = batch_bytes
        self.fsync = fsync
        self.max_frame_bytes = max_frame_bytes
        self.path: Path | None = None  # the segment, created on the first frame
        self.frames_written = 0
        self.records_written = 0
        self.bytes_written = 0
        self.raw_bytes_written = 0
        self._compressor = make_compressor(level)
        self._codec = RecordCodec()
        self._pending: list[Envelope] = []
        self._pending_bytes = 0
        self._fd: int | None = None
        self._closed = False
        self._lock = threading.Lock()

    def append(self, envelope: Envelope) -> None:
        """Buffer ``envelope``; writes a frame when the batch is full."""
        with self._lock:
            if self._closed:
                raise ExchangeError(f"{self.directory}: append after close")
            self._pending.append(envelope)
            self._pending_bytes += len(envelope.payload)
            if len(self._pending) >= self.batch_records or self._pending_bytes >= self.batch_bytes:
                self._write_pending()

    def flush(self) -> None:
        """Write buffered envelopes as one frame (no-op when nothing is buffered)."""
        with self._lock:
            self._write_pending()

    def close(self) -> None:
        """Flush and close the segment; further appends raise."""
        with self._lock:
            if self._closed:
                return
            self._write_pending()
            self._closed = True
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def __enter__(self) -> ExperienceLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> dict[str, int]:
        return {
            "frames_written": self.frames_written,
            "records_written": self.records_written,
            "bytes_written": self.bytes_written,
            "raw_bytes_written": self.raw_bytes_written,
        }

    def state_dict(self) -> dict[str, int]:
        """The counters a resumed run continues from (its frames go to a new segment)."""
        with self._lock:
            return self.stats()

    def load_state_dict(self, state: dict[str, int]) -> None:
        with self._lock:
            self.frames_written = int(state["frames_written"])
            self.records_written = int(state["records_written"])
            self.bytes_written = int(state["bytes_written"])
            self.raw_bytes_written = int(state["raw_bytes_written"])

    def _write_pending(self) -> None:
        if not self._pending:
            return
        fd = self._open()
        payload = self._codec.encode_batch(self._pending)
        frame = encode_frame(
            payload,
            self._compressor,
            max_frame_bytes=self.max_frame_bytes,
            where=str(self.path),
            offset=self.bytes_written,
        )
        # whole or not at all: a full disk never leaves a torn frame behind
        append_whole(
            fd,
            frame,
            str(self.path),
            f"a frame of {len(self._pending)} records was not "
            f"written; the log's {self.bytes_written} bytes before it are kept",
        )
        if self.fsync:
            os.fsync(fd)
        self.frames_written += 1
        self.records_written += len(self._pending)
        self.bytes_written += len(frame)
        self.raw_bytes_written += len(payload)
        self._pending.clear()
        self._pending_bytes = 0

    def _open(self) -> int:
        if self._fd is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self.path = self.directory / f"{time.time_ns():020d}-{os.getpid()}{SEGMENT_SUFFIX}"
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        return self._fd


def log_segments(path: str | os.PathLike[str]) -> list[Path]:
    """Segment files of a log: ``path`` is a run dir, its ``experience/`` dir, or one segment."""
    p = Path(path)
    if p.is_file():
        return [p]
    directory = p / LOG_DIRNAME if (p / LOG_DIRNAME).is_dir() else p
    if not directory.is_dir():
        raise FileNotFoundError(
            f"{p}: expected a run directory containing {LOG_DIRNAME}/, "
            f"an {LOG_DIRNAME}/ directory or a {SEGMENT_SUFFIX} segment"
        )
    return sorted(directory.glob(f"*{SEGMENT_SUFFIX}"))


def read_log(
    path: str | os.PathLike[str],
    *,
    stats: ReadStats | None = None,
    on_error: OnError = "raise",
    kinds: Collection[str] | None = None,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
) -> Iterator[Delivery]:
    """Replay a log: every record, in write order, as a ``Delivery``.

    Unknown kinds are skipped and counted in ``stats.unknown_kinds``; with ``on_error="skip"``
    damaged, truncated and oversize frames and invalid records are counted and skipped too.
    ``kinds`` restricts decoding to those kinds (others are passed over, uncounted).
    """
    stats = stats if stats is not None else ReadStats()
    codec = RecordCodec()
    for segment in log_segments(path):
        size = segment.stat().st_size
        stats.bytes_on_disk += size
        if size == 0:
            continue
        with open(segment, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            yield from iter_records(
                buf,
                source=str(segment),
                codec=codec,
                stats=stats,
                on_error=on_error,
                kinds=kinds,
                max_frame_bytes=max_frame_bytes,
            )


#: Replay is reading: the name the training loop and tools use.
replay = read_log
