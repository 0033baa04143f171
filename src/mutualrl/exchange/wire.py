"""Batches of records as bytes: what crosses a process boundary, and what the log is made of.

``FrameCodec.encode`` turns deliveries into one frame; ``iter_records`` walks the frames of a
buffer (bytes from a socket, or an mmapped log segment) and yields validated records, counting
everything it has to skip in a ``ReadStats``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence

from mutualrl.exchange.codec import Delivery, Envelope, RecordCodec
from mutualrl.exchange.errors import ExchangeError, RecordDecodeError
from mutualrl.exchange.framing import (
    DEFAULT_MAX_FRAME_BYTES,
    Buffer,
    FrameReader,
    OnError,
    ReadStats,
    encode_frame,
    make_compressor,
)


class FrameCodec:
    """Encodes deliveries into frames and decodes frames back (reusable; not thread-safe)."""

    def __init__(self, *, level: int = 3, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._codec = RecordCodec()
        self._compressor = make_compressor(level)

    def encode(self, deliveries: Sequence[Delivery]) -> bytes:
        """One frame holding ``deliveries`` (envelopes at the current schema version)."""
        envelopes = []
        for d in deliveries:
            if self._codec.kind_of(d.record) != d.kind:
                raise ValueError(
                    f"delivery seq {d.seq} from {d.producer!r}: kind {d.kind!r} "
                    f"but record is a {type(d.record).__name__} "
                    f"({self._codec.kind_of(d.record)!r})"
                )
            envelopes.append(
                self._codec.envelope(
                    d.record,
                    kind=d.kind,
                    producer=d.producer,
                    version=d.producer_version,
                    seq=d.seq,
                )
            )
        return encode_frame(
            self._codec.encode_batch(envelopes),
            self._compressor,
            max_frame_bytes=self.max_frame_bytes,
        )

    def decode(
        self,
        data: bytes,
        *,
        source: str = "<bytes>",
        on_error: OnError = "raise",
        stats: ReadStats | None = None,
    ) -> list[Delivery]:
        """All records of the frames in ``data``, validated against their registered types."""
        return list(
            iter_records(
                data,
                source=source,
                codec=self._codec,
                stats=stats,
                on_error=on_error,
                max_frame_bytes=self.max_frame_bytes,
            )
        )


def iter_records(
    buf: Buffer,
    *,
    source: str,
    codec: RecordCodec | None = None,
    stats: ReadStats | None = None,
    on_error: OnError = "raise",
    kinds: Collection[str] | None = None,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
) -> Iterator[Delivery]:
    """Records of the frames in ``buf`` (bytes received from a peer, or a mapped file)."""
    codec = codec or RecordCodec()
    stats = stats if stats is not None else ReadStats()
    reader = FrameReader(
        source=source, stats=stats, on_error=on_error, max_frame_bytes=max_frame_bytes
    )
    for offset, payload in reader.frames(buf):
        where = f"{source} @ byte {offset}"
        try:
            envelopes = codec.decode_batch(payload, where=where)
        except RecordDecodeError as exc:
            _skip_or_raise(exc, stats, on_error, "damaged_frames")
            continue
        for env in envelopes:
            delivery = _decode_one(env, codec, stats, on_error, kinds, where)
            if delivery is not None:
                yield delivery


def _decode_one(
    env: Envelope | RecordDecodeError,
    codec: RecordCodec,
    stats: ReadStats,
    on_error: OnError,
    kinds: Collection[str] | None,
    where: str,
) -> Delivery | None:
    if isinstance(env, RecordDecodeError):
        _skip_or_raise(env, stats, on_error, "invalid_records")
        return None
    if kinds is not None and env.kind not in kinds:
        return None
    try:
        record = codec.decode_record(env, where=where)
    except RecordDecodeError as exc:
        _skip_or_raise(exc, stats, on_error, "invalid_records")
        return None
    if record is None:
        stats.unknown_kinds[env.kind] += 1  # a newer writer's kind: skipping it is by design
        return None
    stats.records += 1
    stats.by_kind_producer[env.kind, env.producer] += 1
    return Delivery(
        kind=env.kind,
        producer=env.producer,
        producer_version=env.producer_version,
        seq=env.seq,
        record=record,
    )


def _skip_or_raise(exc: ExchangeError, stats: ReadStats, on_error: OnError, counter: str) -> None:
    if on_error == "raise":
        raise exc
    stats.note(exc)
    setattr(stats, counter, getattr(stats, counter) + 1)
