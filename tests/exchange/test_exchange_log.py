"""ExperienceLog on disk: segments, batching, crash tails, replay of several segments."""

from __future__ import annotations

import pytest

from mutualrl.exchange import (
    ExchangeError,
    ExperienceLog,
    ReadStats,
    TruncatedFrameError,
    Watermark,
    read_log,
    replay,
)
from mutualrl.exchange.codec import RecordCodec


def env(codec: RecordCodec, seq: int):
    return codec.envelope(
        Watermark(producer="a", version=seq), kind="watermark", producer="a", version=seq, seq=seq
    )


def write(run_dir, seqs, **kw) -> ExperienceLog:
    codec = RecordCodec()
    log = ExperienceLog(run_dir, **kw)
    for s in seqs:
        log.append(env(codec, s))
    log.close()
    return log


def test_nothing_written_until_a_batch_fills_or_flush(tmp_path) -> None:
    codec = RecordCodec()
    log = ExperienceLog(tmp_path, batch_records=3)
    log.append(env(codec, 0))
    assert log.path is None and log.frames_written == 0
    log.flush()
    assert log.frames_written == 1 and log.path.parent == tmp_path / "experience"
    for s in range(1, 5):
        log.append(env(codec, s))
    assert log.frames_written == 2  # the third append filled the batch; one is pending
    log.close()
    assert log.frames_written == 3
    assert log.bytes_written == log.path.stat().st_size
    with pytest.raises(ExchangeError, match="append after close"):
        log.append(env(codec, 9))


def test_each_open_is_a_new_segment_replayed_in_order(tmp_path) -> None:
    write(tmp_path, [0, 1], fsync=True)
    write(tmp_path, [2, 3])
    assert len(list((tmp_path / "experience").iterdir())) == 2
    assert [d.seq for d in replay(tmp_path)] == [0, 1, 2, 3]
    # Also readable from the experience dir or a single segment path.
    assert [d.seq for d in read_log(tmp_path / "experience")] == [0, 1, 2, 3]


def test_crash_tail_of_one_segment_does_not_hide_later_ones(tmp_path) -> None:
    first = write(tmp_path, [0, 1], batch_records=1)
    write(tmp_path, [2], batch_records=1)
    size = first.path.stat().st_size
    with open(first.path, "r+b") as f:
        f.truncate(size - 7)  # the writer died inside its last frame
    with pytest.raises(TruncatedFrameError, match=rf"{first.path.name} @ byte \d+"):
        list(read_log(tmp_path))
    stats = ReadStats()
    assert [d.seq for d in read_log(tmp_path, on_error="skip", stats=stats)] == [0, 2]
    assert stats.truncated_frames == 1 and stats.records == 2


def test_empty_segment_and_missing_directory(tmp_path) -> None:
    (tmp_path / "experience").mkdir()
    (tmp_path / "experience" / "0-1.mrlx").write_bytes(b"")
    stats = ReadStats()
    assert list(read_log(tmp_path, stats=stats)) == [] and stats.bytes_on_disk == 0
    with pytest.raises(FileNotFoundError, match="expected a run directory containing"):
        list(read_log(tmp_path / "nope"))


def test_kinds_filter_and_stats(tmp_path) -> None:
    write(tmp_path, range(5))
    stats = ReadStats()
    assert len(list(read_log(tmp_path, stats=stats, kinds={"rollout"}))) == 0
    stats = ReadStats()
    assert len(list(read_log(tmp_path, stats=stats))) == 5
    assert stats.by_kind == {"watermark": 5} and stats.by_producer == {"a": 5}
    assert stats.bytes_raw > 0 and stats.frames == 1


def test_bad_batch_settings_are_rejected(tmp_path) -> None:
    with pytest.raises(ValueError, match="batch_records and batch_bytes must be >= 1"):
        ExperienceLog(tmp_path, batch_records=0)
