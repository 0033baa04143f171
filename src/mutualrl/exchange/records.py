"""The built-in experience records (schema version 1.x).

Records are frozen, keyword-only ``msgspec.Struct``s. Token ids and log-probs travel as
little-endian ``int32`` / ``float32`` byte strings: msgpack stores them as one ``bin`` value (4
bytes a token instead of up to 9 for a msgpack float), numpy views them without copying, and
JSON (where ``bytes`` are base64) still has a schema for them.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from typing import Annotated, Literal

import msgspec
import numpy as np

from mutualrl.exchange.kinds import experience_type

_TOKEN_DTYPE = np.dtype("<i4")
_LOGPROB_DTYPE = np.dtype("<f4")

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PromptId = Annotated[
    str, msgspec.Meta(pattern="^[0-9a-f]{32}$", description="prompt_id(prompt text)")
]
FinishReason = Literal["stop", "length"]


def prompt_id(text: str) -> str:
    """Content hash of a prompt: blake2b-128 of its UTF-8 bytes, 32 hex chars.

    It depends on the text only, so every policy (whatever its tokenizer) names a prompt alike.
    """
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).hexdigest()


def _pack(values: Sequence | np.ndarray, field: str, kinds: str, dtype, what: str) -> bytes:
    arr = np.asarray(values)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in kinds):
        raise ValueError(
            f"{field}: expected a 1-D sequence of {what}, got dtype {arr.dtype} shape {arr.shape}"
        )
    return arr.astype(dtype, copy=False).tobytes()


def pack_token_ids(ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as little-endian int32 bytes (the ``Rollout.token_ids`` wire form)."""
    return _pack(ids, "token_ids", "iu", _TOKEN_DTYPE, "integers")


def pack_logprobs(values: Sequence[float] | np.ndarray) -> bytes:
    """Log-probs as little-endian float32 bytes (the ``Rollout.logprobs`` wire form)."""
    return _pack(values, "logprobs", "fiu", _LOGPROB_DTYPE, "floats")


@experience_type("rollout")
class Rollout(msgspec.Struct, frozen=True, kw_only=True):
    """One sampled completion of one prompt by one policy, with its reward.

    ``token_ids``/``logprobs`` are the producer's own tokenization of the completion and the
    behaviour log-probs under its policy (int32 / float32 little-endian bytes, same length);
    build them from lists or arrays with ``Rollout.create`` and read them with
    ``token_array`` / ``logprob_array``.
    """

    prompt_id: PromptId
    prompt: str
    completion: str
    producer: str
    tokenizer_id: str
    token_ids: bytes
    logprobs: bytes
    reward: float
    verifier_id: str
    policy_version: NonNegInt
    finish_reason: FinishReason
    family: str = ""
    group_index: NonNegInt | None = None
    sample_index: NonNegInt | None = None

    def __post_init__(self) -> None:
        # Runs on decode too, so a damaged array can never become a silently wrong record.
        if len(self.token_ids) % 4 or len(self.logprobs) % 4:
            raise ValueError("token_ids and logprobs must be whole 4-byte items (int32/float32)")
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(
                f"token_ids has {len(self.token_ids) // 4} items but logprobs has "
                f"{len(self.logprobs) // 4}; expected one log-prob per token"
            )

    @classmethod
    def create(
        cls,
        *,
        token_ids: Sequence[int] | np.ndarray,
        logprobs: Sequence[float] | np.ndarray,
        **fields: object,
    ) -> Rollout:
        """Build from token id / log-prob sequences; ``prompt_id`` defaults to the prompt's hash."""
        fields.setdefault("prompt_id", prompt_id(str(fields["prompt"])))
        return cls(token_ids=pack_token_ids(token_ids), logprobs=pack_logprobs(logprobs), **fields)  # type: ignore[arg-type]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) // 4

    @property
    def token_array(self) -> np.ndarray:
        """Token ids as a read-only int32 array (a view, no copy)."""
        return np.frombuffer(self.token_ids, dtype=_TOKEN_DTYPE)

    @property
    def logprob_array(self) -> np.ndarray:
        """Behaviour log-probs as a read-only float32 array (a view, no copy)."""
        return np.frombuffer(self.logprobs, dtype=_LOGPROB_DTYPE)


@experience_type("group_stats")
class GroupStats(msgspec.Struct, frozen=True, kw_only=True):
    """Reward statistics of one producer's group for one prompt: count, mean and M2.

    M2 is the sum of squared deviations from the mean, so groups from several policies merge
    exactly with Chan et al.'s parallel update (``merge``) instead of averaging averages.
    """

    prompt_id: PromptId
    producer: str
    policy_version: NonNegInt
    count: NonNegInt
    mean: float
    m2: Annotated[float, msgspec.Meta(ge=0.0)]

    @classmethod
    def from_rewards(
        cls, *, prompt_id: str, producer: str, policy_version: int, rewards: Iterable[float]
    ) -> GroupStats:
        """Statistics of ``rewards`` (Welford's update, stable for long groups)."""
        count, mean, m2 = 0, 0.0, 0.0
        for r in rewards:
            count += 1
            delta = float(r) - mean
            mean += delta / count
            m2 += delta * (float(r) - mean)
        return cls(
            prompt_id=prompt_id,
            producer=producer,
            policy_version=policy_version,
            count=count,
            mean=mean,
            m2=max(m2, 0.0),
        )

    @property
    def variance(self) -> float:
        """Population variance (M2 / count); 0 for an empty group."""
        return self.m2 / self.count if self.count else 0.0

    @property
    def std(self) -> float:
        """Population standard deviation, as GRPO's z-score uses."""
        return math.sqrt(self.variance)


def merge(a: GroupStats, b: GroupStats, *, producer: str | None = None) -> GroupStats:
    """Statistics of the union of two groups for the same prompt (Chan's parallel merge).

    ``producer`` defaults to the common producer, else the sorted '+'-joined names;
    ``policy_version`` is the newer of the two.
    """
    if a.prompt_id != b.prompt_id:
        raise ValueError(
            f"merge: prompt_id differs ({a.prompt_id} vs {b.prompt_id}); "
            "expected statistics of the same prompt"
        )
    count = a.count + b.count
    if count == 0:
        mean, m2 = 0.0, 0.0
    else:
        delta = b.mean - a.mean
        mean = a.mean + delta * b.count / count
        m2 = a.m2 + b.m2 + delta * delta * a.count * b.count / count
    if producer is None:
        names = sorted({*a.producer.split("+"), *b.producer.split("+")})
        producer = "+".join(names)
    return GroupStats(
        prompt_id=a.prompt_id,
        producer=producer,
        policy_version=max(a.policy_version, b.policy_version),
        count=count,
        mean=mean,
        m2=m2,
    )


@experience_type("verified_success")
class VerifiedSuccess(msgspec.Struct, frozen=True, kw_only=True):
    """A completion a verifier accepted (reward at or above the sharing threshold).

    Text only: a receiver retokenizes it with its own tokenizer for SFT (success-gated transfer).
    """

    prompt_id: PromptId
    prompt: str
    completion: str
    reward: float
    verifier_id: str
    verifier_version: str
    source: str
    policy_version: NonNegInt
    family: str = ""


@experience_type("watermark")
class Watermark(msgspec.Struct, frozen=True, kw_only=True):
    """The latest policy version ``producer`` has published (pacing and staleness bounds)."""

    producer: str
    version: NonNegInt


#: Built-in kinds, in schema order (the checked-in JSON Schema covers exactly these).
BUILTIN_KINDS: tuple[str, ...] = (
    "rollout",
    "group_stats",
    "verified_success",
    "watermark",
    "alignment_residuals",
)


# THL's per-trajectory residual record (what a retokenization cost) is a built-in kind, so every
# reader of a run's log knows it; the struct lives with the layer that computes it.
from mutualrl.retokenize.residuals import AlignmentResiduals  # noqa: E402

experience_type("alignment_residuals")(AlignmentResiduals)
