"""Frames: how batches of envelopes sit in a file or a byte stream.

Layout of one frame (little-endian, 24-byte header, then one zstd frame)::

    0   4  magic        b"MRLX"
    4   1  format       frame format version, 1
    5   1  flags        0 (reserved)
    6   2  reserved     0
    8   4  stored_len   bytes of the zstd frame that follows
    12  4  raw_len      bytes after decompression (the msgpack batch)
    16  4  payload_crc  CRC-32 of the zstd frame bytes
    20  4  header_crc   CRC-32 of header bytes 0..20
    24  .. zstd frame   with content size and zstd's own xxhash64 content checksum

Why two checksums: the header CRC makes the lengths trustworthy, so a damaged payload is skipped
by length without losing the frames after it; a damaged header is skipped by scanning for the
next magic (a false magic inside compressed data fails its header CRC). The payload CRC rejects
damage before any decompression work; zstd's content checksum guards what decompression returns.
"""

from __future__ import annotations

import mmap
import struct
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

import zstandard

from mutualrl.exchange.errors import (
    DamagedFrameError,
    FrameError,
    OversizeFrameError,
    TruncatedFrameError,
    UnsupportedVersionError,
)

MAGIC = b"MRLX"
FRAME_FORMAT = 1
_HEADER = struct.Struct("<4sBBHIIII")
HEADER_SIZE = _HEADER.size  # 24
_CRC_SPAN = HEADER_SIZE - 4
#: Default cap on a frame's stored and decompressed size: a guard against a damaged or hostile
#: length making a reader allocate gigabytes.
DEFAULT_MAX_FRAME_BYTES = 64 << 20

OnError = Literal["raise", "skip"]
#: What frames are read from: whole-file bytes or an mmap (both slice to bytes and ``find``).
Buffer = bytes | mmap.mmap


@dataclass
class ReadStats:
    """What a reader saw: counts of good data and of everything it skipped (never silent)."""

    frames: int = 0
    records: int = 0
    bytes_on_disk: int = 0
    bytes_raw: int = 0
    damaged_frames: int = 0
    truncated_frames: int = 0
    oversize_frames: int = 0
    skipped_bytes: int = 0
    invalid_records: int = 0
    unknown_kinds: Counter[str] = field(default_factory=Counter)
    by_kind_producer: Counter[tuple[str, str]] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)  # first messages, for humans

    @property
    def by_kind(self) -> Counter[str]:
        out: Counter[str] = Counter()
        for (kind, _), n in self.by_kind_producer.items():
            out[kind] += n
        return out

    @property
    def by_producer(self) -> Counter[str]:
        out: Counter[str] = Counter()
        for (_, producer), n in self.by_kind_producer.items():
            out[producer] += n
        return out

    def note(self, error: Exception) -> None:
        if len(self.errors) < 20:
            self.errors.append(str(error))

    @property
    def skipped(self) -> int:
        """Frames and records that were not returned, whatever the reason."""
        return (
            self.damaged_frames
            + self.truncated_frames
            + self.oversize_frames
            + self.invalid_records
            + sum(self.unknown_kinds.values())
        )


def encode_frame(
    payload: bytes,
    compressor: zstandard.ZstdCompressor,
    *,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    where: str = "<frame>",
    offset: int = 0,
) -> bytes:
    """One complete frame (header + zstd frame) for ``payload``.

    ``compressor`` must write the content size and checksum (see ``make_compressor``).
    Raises ``OversizeFrameError`` rather than write a frame default readers would refuse.
    """
    if len(payload) > max_frame_bytes:
        raise OversizeFrameError(
            f"batch of {len(payload)} bytes exceeds max_frame_bytes="
            f"{max_frame_bytes}; flush smaller batches",
            source=where,
            offset=offset,
        )
    body = compressor.compress(payload)
    head = struct.pack(
        "<4sBBHIII", MAGIC, FRAME_FORMAT, 0, 0, len(body), len(payload), zlib.crc32(body)
    )
    return head + struct.pack("<I", zlib.crc32(head)) + body


def make_compressor(level: int = 3) -> zstandard.ZstdCompressor:
    """A zstd compressor configured as frames require (content size + content checksum)."""
    return zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True)


class FrameReader:
    """Iterates the decompressed payloads of the frames in a buffer, with resync on damage.

    ``on_error="raise"`` raises a ``FrameError`` naming ``source`` and the byte offset;
    ``"skip"`` counts the problem in ``stats`` and goes on with the next frame.
    A frame of an unknown format version is always refused (``UnsupportedVersionError``).
    """

    def __init__(
        self,
        *,
        source: str,
        stats: ReadStats,
        on_error: OnError = "raise",
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    ) -> None:
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error: expected 'raise' or 'skip', got {on_error!r}")
        self.source = source
        self.stats = stats
        self.on_error = on_error
        self.max_frame_bytes = max_frame_bytes
        self._decompressor = zstandard.ZstdDecompressor()

    def frames(self, buf: Buffer) -> Iterator[tuple[int, bytes]]:
        """Yield ``(offset, payload)`` for every good frame in ``buf``."""
        pos, end = 0, len(buf)
        while pos < end:
            try:
                payload, nxt = self._read_at(buf, pos)
            except FrameError as exc:
                if self.on_error == "raise":
                    raise
                self.stats.note(exc)
                nxt = self._skip_target(buf, pos, exc)
                self.stats.skipped_bytes += nxt - pos
                pos = nxt
                continue
            yield pos, payload
            pos = nxt

    def _skip_target(self, buf: Buffer, pos: int, exc: FrameError) -> int:
        # A frame whose header checked out is skipped by its length; anything else (bad magic,
        # bad header, truncated) by scanning for the next magic.
        if isinstance(exc, TruncatedFrameError):
            self.stats.truncated_frames += 1
        elif isinstance(exc, OversizeFrameError):
            self.stats.oversize_frames += 1
        else:
            self.stats.damaged_frames += 1
        if exc.frame_end is not None:
            return min(exc.frame_end, len(buf))
        found = buf.find(MAGIC, pos + 1)
        return len(buf) if found < 0 else found

    def _read_at(self, buf: Buffer, pos: int) -> tuple[bytes, int]:
        header = self._header_at(buf, pos)
        _, fmt, _, _, stored_len, raw_len, payload_crc, _ = header
        body_start = pos + HEADER_SIZE
        frame_end = body_start + stored_len
        if fmt != FRAME_FORMAT:
            raise UnsupportedVersionError(
                f"{self.source} @ byte {pos}: frame format {fmt}; this "
                f"reader understands format {FRAME_FORMAT}"
            )
        if max(stored_len, raw_len) > self.max_frame_bytes:
            raise OversizeFrameError(
                f"frame declares {stored_len} stored / {raw_len} raw bytes; max_frame_bytes is "
                f"{self.max_frame_bytes}",
                source=self.source,
                offset=pos,
                frame_end=frame_end,
            )
        if frame_end > len(buf):
            raise TruncatedFrameError(
                f"frame needs {HEADER_SIZE + stored_len} bytes but only {len(buf) - pos} remain",
                source=self.source,
                offset=pos,
            )
        body = buf[body_start:frame_end]
        if zlib.crc32(body) != payload_crc:
            raise DamagedFrameError(
                "payload CRC-32 mismatch", source=self.source, offset=pos, frame_end=frame_end
            )
        payload = self._decompress(body, raw_len, pos, frame_end)
        self.stats.frames += 1
        self.stats.bytes_raw += raw_len
        return payload, frame_end

    def _header_at(self, buf: Buffer, pos: int) -> tuple:
        if len(buf) - pos < HEADER_SIZE:
            if bytes(buf[pos : pos + 4]) == MAGIC[: min(4, len(buf) - pos)]:
                raise TruncatedFrameError(
                    f"data ends {len(buf) - pos} bytes into a {HEADER_SIZE}-byte frame header",
                    source=self.source,
                    offset=pos,
                )
            raise DamagedFrameError("expected frame magic b'MRLX'", source=self.source, offset=pos)
        raw_header = bytes(buf[pos : pos + HEADER_SIZE])
        header = _HEADER.unpack(raw_header)
        if header[0] != MAGIC:
            raise DamagedFrameError(
                f"expected frame magic b'MRLX', found {header[0]!r}", source=self.source, offset=pos
            )
        if zlib.crc32(raw_header[:_CRC_SPAN]) != header[7]:
            raise DamagedFrameError("frame header CRC-32 mismatch", source=self.source, offset=pos)
        return header

    def _decompress(self, body: bytes, raw_len: int, pos: int, frame_end: int) -> bytes:
        try:
            payload = self._decompressor.decompress(body, max_output_size=raw_len)
        except zstandard.ZstdError as exc:
            raise DamagedFrameError(
                f"zstd frame does not decompress ({exc})",
                source=self.source,
                offset=pos,
                frame_end=frame_end,
            ) from exc
        if len(payload) != raw_len:
            raise DamagedFrameError(
                f"decompressed to {len(payload)} bytes; header says {raw_len}",
                source=self.source,
                offset=pos,
                frame_end=frame_end,
            )
        return payload
