"""Shared Experience Exchange (SEE): typed, versioned experience records flowing between policies.

In process, ``ExperienceBus`` hands the published Struct objects to filtered, bounded
subscriptions; on disk and across processes, records travel in envelopes, batched into
checksummed zstd frames (``ExperienceLog``, ``FrameCodec``). The wire protocol is specified in
``protocols/experience.md`` and ``protocols/experience.schema.json``.
"""

from mutualrl.exchange.bus import ExperienceBus, Subscription
from mutualrl.exchange.codec import SCHEMA_VERSION, Delivery, Envelope
from mutualrl.exchange.errors import (
    BusClosedError,
    DamagedFrameError,
    ExchangeError,
    FrameError,
    OversizeFrameError,
    RecordDecodeError,
    SubscriberOverflowError,
    TruncatedFrameError,
    UnknownKindError,
    UnsupportedVersionError,
)
from mutualrl.exchange.framing import ReadStats
from mutualrl.exchange.kinds import EXPERIENCE_TYPES, experience_type
from mutualrl.exchange.log import ExperienceLog, read_log, replay
from mutualrl.exchange.records import (
    GroupStats,
    Rollout,
    VerifiedSuccess,
    Watermark,
    merge,
    prompt_id,
)
from mutualrl.exchange.wire import FrameCodec, iter_records

__all__ = [
    "EXPERIENCE_TYPES",
    "SCHEMA_VERSION",
    "BusClosedError",
    "DamagedFrameError",
    "Delivery",
    "Envelope",
    "ExchangeError",
    "ExperienceBus",
    "ExperienceLog",
    "FrameCodec",
    "FrameError",
    "GroupStats",
    "OversizeFrameError",
    "ReadStats",
    "RecordDecodeError",
    "Rollout",
    "SubscriberOverflowError",
    "Subscription",
    "TruncatedFrameError",
    "UnknownKindError",
    "UnsupportedVersionError",
    "VerifiedSuccess",
    "Watermark",
    "experience_type",
    "iter_records",
    "merge",
    "prompt_id",
    "read_log",
    "replay",
]
