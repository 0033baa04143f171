"""The built-in pointer task: name the word at a position of a short list.

``"first: cat dog sun tree ="`` -> ``" cat"``; ``"last: cat dog sun tree ="`` -> ``" tree"``.

Why this task: copy-style answers (a word taken from the prompt) are learnt by 2-layer models
with a few thousand parameters per token in seconds on a CPU, while arithmetic is not (see the
calibration in the design notes). Each position keyword is a prompt *family*; a policy warm
started on one family answers every prompt as if it were that family, so it solves its own family
and never its peer's. That complementarity is what makes experience sharing measurable: without
sharing, the peer family's reward is always 0 and GRPO gets no gradient there.

The embedded default uses the ``lookup`` task instead: for a 2-layer policy, taking up a peer's
family here means learning a keyword-conditioned rule, which measured at about 50 SFT steps of 16
examples at learning rate 3e-3, more than a short compare supplies.

Every word is a single token in both packaged tokenizers (checked in tests), and the held-out
split is a deterministic hash partition of word tuples, disjoint from the training split.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from mutualrl.tasks.base import TASKS, Prompt, Split, TaskError

WORDS = (
    "cat dog sun tree red blue car fish bird book milk rain star moon king ship gold door "
    "hand road wind fire cake lamp rock bell leaf nest rope box cup hat pen egg bus map key"
).split()
POSITIONS = {"first": 0, "second": 1, "third": 2, "last": -1}
HELDOUT_SHARE = 8  # one word tuple in 8 is held out


def _is_heldout(words: Sequence[str]) -> bool:
    digest = hashlib.blake2b(" ".join(words).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") % HELDOUT_SHARE == 0


class ExactMatchVerifier:
    """Reward 1 when the completion, stripped of surrounding white space, equals the answer."""

    verifier_id = "exact-match"
    version = 1

    def __call__(self, prompt: Prompt, completion: str) -> float:
        return 1.0 if completion.strip() == prompt.answer.strip() else 0.0


class PointerTask:
    def __init__(self, families: Sequence[str] = ("first", "last"), num_words: int = 4) -> None:
        unknown = [f for f in families if f not in POSITIONS]
        if unknown:
            raise TaskError(
                f"task.families: unknown pointer families {unknown}; known: {sorted(POSITIONS)}"
            )
        if not 2 <= num_words <= len(WORDS):
            raise TaskError(f"task.num_words must be in [2, {len(WORDS)}], got {num_words}")
        self.families = tuple(families) or ("first", "last")
        self.num_words = num_words
        self.verifier = ExactMatchVerifier()

    def sample(
        self, rng: np.random.Generator, n: int, split: Split, families: Sequence[str] | None = None
    ) -> list[Prompt]:
        if split == "validation":
            raise TaskError(
                "the pointer task has no validation split (train and held-out only); "
                "use the arithmetic task or a data file with rows marked 'validation'"
            )
        fams = tuple(families) if families else self.families
        # Families are stratified (round robin from a random start), not drawn independently:
        # with a few prompts per step an unlucky mix would move a policy's mean reward more
        # than learning does.
        start = int(rng.integers(len(fams)))
        out: list[Prompt] = []
        while len(out) < n:
            words = [WORDS[i] for i in rng.choice(len(WORDS), self.num_words, replace=False)]
            if _is_heldout(words) != (split == "heldout"):
                continue
            family = fams[(start + len(out)) % len(fams)]
            out.append(
                Prompt(
                    text=f"{family}: {' '.join(words)} =",
                    answer=" " + words[POSITIONS[family]],
                    family=family,
                )
            )
        return out

    def demonstration(self, prompt: Prompt) -> str:
        return prompt.answer


@TASKS.register("pointer")
def _make_pointer(cfg) -> PointerTask:
    return PointerTask(families=cfg.families or ("first", "last"), num_words=cfg.num_words)
