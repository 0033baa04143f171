"""Errors of the experience exchange.

Every error names where the problem is (file and byte offset, or kind/producer/seq) and what was
expected, so a damaged run directory can be diagnosed from the message alone.
"""

from __future__ import annotations


class ExchangeError(Exception):
    """Base class of every error raised by ``mutualrl.exchange``."""


class FrameError(ExchangeError):
    """A frame on disk or on the wire could not be used.

    ``source`` names the file (or stream) and ``offset`` the byte offset of the frame's magic.
    ``frame_end`` is set when the frame's header checked out, so a skipping reader can resume
    right after this frame instead of scanning for the next magic.
    """

    def __init__(
        self, message: str, *, source: str, offset: int, frame_end: int | None = None
    ) -> None:
        super().__init__(f"{source} @ byte {offset}: {message}")
        self.source = source
        self.offset = offset
        self.frame_end = frame_end


class DamagedFrameError(FrameError):
    """Header or payload checksum mismatch, or a payload that does not decompress/decode."""


class TruncatedFrameError(DamagedFrameError):
    """The data ends inside a frame (a crashed writer or a truncated copy)."""


class OversizeFrameError(FrameError):
    """A frame declares more bytes than the reader's ``max_frame_bytes`` allows."""


class UnsupportedVersionError(ExchangeError):
    """An envelope carries a schema MAJOR version this reader does not understand."""


class RecordDecodeError(ExchangeError):
    """A record's payload does not match its registered type (wrong field type, bad value)."""


class UnknownKindError(ExchangeError, TypeError):
    """A record type was published that is not registered with ``@experience_type``."""


class SubscriberOverflowError(ExchangeError):
    """A subscriber with ``overflow="block"`` stayed full past its timeout."""


class BusClosedError(ExchangeError):
    """``publish`` was called after ``ExperienceBus.close()``."""
