"""Envelope and the record <-> bytes codec (msgpack; the frame layer adds zstd and checksums).

Two layers on the wire: an ``Envelope`` whose ``payload`` is the record's own msgpack bytes
(``msgspec.Raw``), so a reader decodes the envelope, looks ``kind`` up in the registry and either
decodes the payload with that type or skips it -- an old reader never has to understand a new
kind to read the rest of a batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, cast

import msgspec

from mutualrl.exchange.errors import RecordDecodeError, UnsupportedVersionError
from mutualrl.exchange.kinds import EXPERIENCE_TYPES, check_record_type, kind_of
from mutualrl.registry import Registry

#: (MAJOR, MINOR) of the experience protocol this code writes. Readers accept any MINOR of their
#: MAJOR (new optional fields are ignored by old readers) and refuse another MAJOR.
SCHEMA_VERSION: tuple[int, int] = (1, 0)

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]


class Envelope(msgspec.Struct, frozen=True, kw_only=True):
    """The wire wrapper of one record.

    ``schema_version`` has no default so it is always on the wire; its shape, a 2-item
    ``[major, minor]`` array, is frozen forever so any reader can find out what it is reading.
    ``seq`` is assigned per producer by the bus; (producer, seq) identifies a record for
    at-least-once de-duplication.
    """

    schema_version: tuple[int, int]
    kind: Annotated[str, msgspec.Meta(description="registered experience kind of the payload")]
    producer: str
    producer_version: NonNegInt
    seq: NonNegInt
    payload: Annotated[
        msgspec.Raw,
        msgspec.Meta(description="the record of `kind`, msgpack-encoded on the wire (see x-kinds)"),
    ]


class Delivery(msgspec.Struct, frozen=True, kw_only=True):
    """A decoded record with its envelope metadata (in process only; never on the wire)."""

    kind: str
    producer: str
    producer_version: int
    seq: int
    record: Any


class _VersionProbe(msgspec.Struct):
    """Reads only ``schema_version`` of an envelope that does not decode as ours."""

    schema_version: tuple[int, int]


def check_version(version: tuple[int, int], where: str) -> None:
    """Refuse an envelope of another MAJOR version (a newer minor is fine)."""
    if version[0] != SCHEMA_VERSION[0]:
        raise UnsupportedVersionError(
            f"{where}: envelope schema_version {version[0]}.{version[1]} has MAJOR {version[0]}; "
            f"this reader understands MAJOR {SCHEMA_VERSION[0]} "
            f"(writes {SCHEMA_VERSION[0]}.{SCHEMA_VERSION[1]}); upgrade mutualrl to read it"
        )


class RecordCodec:
    """Encodes records into envelopes/batches and decodes them back, one decoder per kind.

    Not thread-safe (it caches decoders): each bus, log writer and reader owns one.
    """

    def __init__(self, registry: Registry[type[msgspec.Struct]] = EXPERIENCE_TYPES) -> None:
        self.registry = registry
        self._encoder = msgspec.msgpack.Encoder()
        self._batch_decoder = msgspec.msgpack.Decoder(list[Envelope])
        self._raw_list_decoder = msgspec.msgpack.Decoder(list[msgspec.Raw])
        self._envelope_decoder = msgspec.msgpack.Decoder(Envelope)
        self._probe_decoder = msgspec.msgpack.Decoder(_VersionProbe)
        self._decoders: dict[str, msgspec.msgpack.Decoder] = {}
        self._kinds: dict[type, str] = {}

    def kind_of(self, record: msgspec.Struct) -> str:
        """The registered kind of ``record`` (cached per type)."""
        cls = type(record)
        kind = self._kinds.get(cls)
        if kind is None:
            kind = self._kinds[cls] = kind_of(cls, self.registry)
        return kind

    def envelope(
        self, record: msgspec.Struct, *, kind: str, producer: str, version: int, seq: int
    ) -> Envelope:
        """Wrap ``record`` (payload encoded now) in a current-version envelope.

        The payload is decoded back once: msgspec checks types and constraints only when
        decoding, so a record built with a bad value (say ``policy_version=-1``) is refused here,
        at its producer, instead of turning up as an invalid record in every reader.
        """
        payload = self._encoder.encode(record)
        try:
            self._decoder(kind).decode(payload)
        except msgspec.ValidationError as exc:
            raise RecordDecodeError(
                f"{kind!r} record seq {seq} from {producer!r} would not be readable: {exc}"
            ) from exc
        return Envelope(
            schema_version=SCHEMA_VERSION,
            kind=kind,
            producer=producer,
            producer_version=version,
            seq=seq,
            payload=msgspec.Raw(payload),
        )

    def encode_batch(self, envelopes: Sequence[Envelope]) -> bytes:
        """A batch of envelopes as one msgpack array (the uncompressed frame payload)."""
        return self._encoder.encode(envelopes)

    def decode_batch(self, data: bytes, *, where: str) -> list[Envelope | RecordDecodeError]:
        """Envelopes of a batch; a malformed envelope becomes a ``RecordDecodeError`` item.

        Raises ``UnsupportedVersionError`` for another MAJOR, ``RecordDecodeError`` when the
        payload is not a msgpack array at all.
        """
        try:
            envelopes = cast("list[Envelope | RecordDecodeError]", self._batch_decoder.decode(data))
        except (msgspec.ValidationError, msgspec.DecodeError):
            envelopes = self._decode_one_by_one(data, where)
        for env in envelopes:
            if isinstance(env, Envelope):
                check_version(env.schema_version, f"{where} seq {env.seq} of {env.producer!r}")
        return envelopes

    def _decode_one_by_one(self, data: bytes, where: str) -> list[Envelope | RecordDecodeError]:
        # Slow path, only for a batch that failed as a whole: find the offending envelopes and
        # tell a future-version envelope (refused) from a malformed one (skippable).
        try:
            raws = self._raw_list_decoder.decode(data)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise RecordDecodeError(
                f"{where}: frame payload is not a msgpack array of envelopes ({exc})"
            ) from exc
        out: list[Envelope | RecordDecodeError] = []
        for i, raw in enumerate(raws):
            try:
                out.append(self._envelope_decoder.decode(raw))
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                try:
                    check_version(
                        self._probe_decoder.decode(raw).schema_version, f"{where} envelope #{i}"
                    )
                except (msgspec.ValidationError, msgspec.DecodeError):
                    pass  # no readable version: report the envelope error itself
                out.append(
                    RecordDecodeError(f"{where} envelope #{i}: expected an Envelope ({exc})")
                )
        return out

    def decode_record(self, env: Envelope, *, where: str) -> msgspec.Struct | None:
        """The record inside ``env``; ``None`` when its kind is unknown to this reader.

        Raises ``RecordDecodeError`` naming kind, producer, seq and msgspec's field path.
        """
        if env.kind not in self._decoders and env.kind not in self.registry:
            return None
        try:
            return self._decoder(env.kind).decode(env.payload)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise RecordDecodeError(
                f"{where}: {env.kind!r} record seq {env.seq} from {env.producer!r} does not match "
                f"its type: {exc}"
            ) from exc

    def _decoder(self, kind: str) -> msgspec.msgpack.Decoder:
        decoder = self._decoders.get(kind)
        if decoder is None:
            cls = self.registry.get(kind)
            check_record_type(kind, cls)  # entry points bypass the decorator's check
            decoder = self._decoders[kind] = msgspec.msgpack.Decoder(cls)
        return decoder
