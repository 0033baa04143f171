"""An experience type whose decorator and entry point give the same kind, ``critique``."""

import msgspec

from mutualrl.exchange import experience_type


@experience_type("critique")
class Critique(msgspec.Struct, frozen=True, kw_only=True):
    prompt_id: str
    text: str
    score: float
