"""Frames and envelopes on the wire: round trips, golden files, and every kind of bad input.

Each bad input must give a specific ``ExchangeError`` (raise mode) or a counted skip (skip mode)
with the good frames before and after it still readable -- never a crash, never a wrong record.
"""

from __future__ import annotations

import msgspec
import pytest
from exchange_golden import GOLDEN_DIR, v1_deliveries
from hypothesis import given, settings
from hypothesis import strategies as st

from mutualrl.exchange import (
    SCHEMA_VERSION,
    DamagedFrameError,
    Delivery,
    ExchangeError,
    OversizeFrameError,
    ReadStats,
    RecordDecodeError,
    TruncatedFrameError,
    UnsupportedVersionError,
    Watermark,
    iter_records,
)
from mutualrl.exchange.codec import Envelope, RecordCodec
from mutualrl.exchange.framing import HEADER_SIZE, encode_frame, make_compressor
from mutualrl.exchange.wire import FrameCodec


def mark(seq: int, producer: str = "a") -> Delivery:
    return Delivery(
        kind="watermark",
        producer=producer,
        producer_version=seq,
        seq=seq,
        record=Watermark(producer=producer, version=seq),
    )


def three_frames() -> tuple[bytes, list[int]]:
    """Three frames of two watermarks each; returns the bytes and each frame's offset."""
    codec = FrameCodec()
    frames = [codec.encode([mark(2 * i), mark(2 * i + 1)]) for i in range(3)]
    offsets = [0, len(frames[0]), len(frames[0]) + len(frames[1])]
    return b"".join(frames), offsets


def frame_of(envelopes: list[Envelope]) -> bytes:
    return encode_frame(RecordCodec().encode_batch(envelopes), make_compressor())


def envelope(
    payload: object,
    *,
    kind: str = "watermark",
    version: tuple[int, int] = SCHEMA_VERSION,
    seq: int = 0,
) -> Envelope:
    return Envelope(
        schema_version=version,
        kind=kind,
        producer="a",
        producer_version=0,
        seq=seq,
        payload=msgspec.Raw(msgspec.msgpack.encode(payload)),
    )


def seqs(data: bytes, **kw: object) -> list[int]:
    return [d.seq for d in iter_records(data, source="mem", **kw)]


def test_round_trip_keeps_records_and_metadata() -> None:
    codec = FrameCodec()
    items = v1_deliveries()
    assert codec.decode(codec.encode(items)) == items


@pytest.mark.parametrize("path", sorted(GOLDEN_DIR.glob("v1_*.bin")), ids=lambda p: p.name)
def test_golden_v1_files_stay_decodable(path) -> None:
    stats = ReadStats()
    got = list(iter_records(path.read_bytes(), source=str(path), stats=stats))
    assert got == v1_deliveries()
    assert stats.skipped == 0 and stats.frames == 1


def test_flipped_payload_byte_is_named_and_skippable() -> None:
    data, offsets = three_frames()
    bad = bytearray(data)
    bad[offsets[1] + HEADER_SIZE + 10] ^= 0xFF
    with pytest.raises(DamagedFrameError, match=rf"mem @ byte {offsets[1]}: payload CRC-32"):
        seqs(bytes(bad))
    stats = ReadStats()
    assert seqs(bytes(bad), on_error="skip", stats=stats) == [0, 1, 4, 5]
    assert stats.damaged_frames == 1 and stats.skipped_bytes == offsets[2] - offsets[1]


@pytest.mark.parametrize("where", [0, 9, 21])  # magic, stored_len, header crc
def test_damaged_header_resyncs_on_next_magic(where: int) -> None:
    data, offsets = three_frames()
    bad = bytearray(data)
    bad[offsets[1] + where] ^= 0x5A
    with pytest.raises(DamagedFrameError, match=f"mem @ byte {offsets[1]}"):
        seqs(bytes(bad))
    stats = ReadStats()
    assert seqs(bytes(bad), on_error="skip", stats=stats) == [0, 1, 4, 5]
    assert stats.damaged_frames == 1


@pytest.mark.parametrize("cut", [3, HEADER_SIZE - 1, HEADER_SIZE + 5, -1])
def test_truncated_tail(cut: int) -> None:
    data, offsets = three_frames()
    short = data[: offsets[2] + cut] if cut >= 0 else data[:cut]
    with pytest.raises(TruncatedFrameError, match=f"mem @ byte {offsets[2]}"):
        seqs(short)
    stats = ReadStats()
    assert seqs(short, on_error="skip", stats=stats) == [0, 1, 2, 3]
    assert stats.truncated_frames == 1


def test_garbage_between_frames_is_skipped_and_counted() -> None:
    data, offsets = three_frames()
    spliced = data[: offsets[1]] + b"\x00junk\x00" + data[offsets[1] :]
    with pytest.raises(DamagedFrameError, match="expected frame magic"):
        seqs(spliced)
    stats = ReadStats()
    assert seqs(spliced, on_error="skip", stats=stats) == list(range(6))
    assert stats.skipped_bytes == 6


def test_oversize_frame_is_refused_or_skipped() -> None:
    big = FrameCodec().encode([mark(9, producer="x" * 5000)])
    data = FrameCodec().encode([mark(0)]) + big + FrameCodec().encode([mark(1)])
    with pytest.raises(OversizeFrameError, match="max_frame_bytes is 1000"):
        seqs(data, max_frame_bytes=1000)
    stats = ReadStats()
    assert seqs(data, on_error="skip", stats=stats, max_frame_bytes=1000) == [0, 1]
    assert stats.oversize_frames == 1
    with pytest.raises(OversizeFrameError, match="flush smaller batches"):
        FrameCodec(max_frame_bytes=1000).encode([mark(9, producer="x" * 5000)])


def test_future_major_version_is_refused_even_when_skipping() -> None:
    future = frame_of([envelope({"producer": "a", "version": 1}, version=(2, 0))])
    for mode in ("raise", "skip"):
        with pytest.raises(
            UnsupportedVersionError, match="MAJOR 2; this reader understands MAJOR 1"
        ):
            seqs(future, on_error=mode)


def test_future_major_with_a_new_envelope_shape_is_still_recognised() -> None:
    odd = {"schema_version": [3, 1], "type": "watermark", "body": b"\x00"}
    data = encode_frame(msgspec.msgpack.encode([odd]), make_compressor())
    with pytest.raises(UnsupportedVersionError, match="MAJOR 3"):
        seqs(data, on_error="skip")


def test_unknown_frame_format_is_refused() -> None:
    import struct
    import zlib

    data = bytearray(FrameCodec().encode([mark(0)]))
    data[4] = 2  # frame format 2, with a header CRC that checks out
    data[20:24] = struct.pack("<I", zlib.crc32(bytes(data[:20])))
    with pytest.raises(UnsupportedVersionError, match="mem @ byte 0: frame format 2"):
        seqs(bytes(data), on_error="skip")


def test_newer_minor_with_extra_fields_is_read() -> None:
    payload = {"producer": "a", "version": 7, "added_in_1_1": [1, 2]}
    data = frame_of([envelope(payload, version=(1, 1))])
    (d,) = iter_records(data, source="mem")
    assert d.record == Watermark(producer="a", version=7)


def test_unknown_kind_is_skipped_and_counted() -> None:
    data = frame_of(
        [
            envelope({"x": 1}, kind="from.the.future", seq=0),
            envelope({"producer": "a", "version": 1}, seq=1),
        ]
    )
    stats = ReadStats()
    assert seqs(data, stats=stats) == [1]  # even in raise mode: skipping kinds is by design
    assert stats.unknown_kinds == {"from.the.future": 1}


def test_wrong_field_type_names_kind_seq_and_field() -> None:
    data = frame_of(
        [
            envelope({"producer": "a", "version": "seven"}, seq=0),
            envelope({"producer": "a", "version": 1}, seq=1),
        ]
    )
    with pytest.raises(RecordDecodeError, match=r"'watermark' record seq 0 .*\$\.version"):
        seqs(data)
    stats = ReadStats()
    assert seqs(data, on_error="skip", stats=stats) == [1]
    assert stats.invalid_records == 1


def test_malformed_envelope_is_an_invalid_record() -> None:
    good = msgspec.msgpack.encode(envelope({"producer": "a", "version": 1}, seq=1))
    raw = b"\x92" + msgspec.msgpack.encode({"schema_version": [1, 0], "kind": 5}) + good
    data = encode_frame(raw, make_compressor())
    with pytest.raises(RecordDecodeError, match="envelope #0: expected an Envelope"):
        seqs(data)
    stats = ReadStats()
    assert seqs(data, on_error="skip", stats=stats) == [1]
    assert stats.invalid_records == 1


def test_payload_that_is_not_a_batch_is_a_damaged_frame() -> None:
    data = encode_frame(b"\xc1not msgpack", make_compressor())
    with pytest.raises(RecordDecodeError, match="not a msgpack array of envelopes"):
        seqs(data)
    stats = ReadStats()
    assert seqs(data, on_error="skip", stats=stats) == []
    assert stats.damaged_frames == 1


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.data())
def test_random_damage_never_crashes_or_invents_records(data: st.DataObject) -> None:
    clean, _ = three_frames()
    originals = {d.seq: d for d in iter_records(clean, source="mem")}
    bad = bytearray(clean)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(bad) - 1))
        bad[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(bad)))
    damaged = bytes(bad[:cut])
    try:
        list(iter_records(damaged, source="mem"))
    except ExchangeError:
        pass  # a specific error is fine; anything else fails the test
    stats = ReadStats()
    for d in iter_records(damaged, source="mem", on_error="skip", stats=stats):
        assert originals[d.seq] == d  # whatever survives is exactly what was written
