"""The built-in lookup task: recall a fact from a table only some policies were taught.

``"cat sun rain apple ="`` -> ``" river"``: the last word is a *key*, the answer its value in a
fixed table; the words before it are context to ignore. Each family is its own table, with keys
and values no other family uses. A policy warm started on one family's table answers its keys and
has never produced any of the other tables' values, so on a peer family its reward is 0 at every
sample: GRPO alone has no signal there, and only experience from a peer that knows the table
(its verified successes) can teach it. This is the small-scale picture of mutual RL between
models with different knowledge.

Every word is a single token with a leading space in both packaged tokenizers (checked in
tests). The held-out split is a deterministic hash partition of whole prompts: held-out prompts
ask the same facts in contexts never seen in training, so held-out accuracy measures whether a
policy learnt the fact rather than the prompt.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from mutualrl.tasks.base import TASKS, Prompt, Split, TaskError
from mutualrl.tasks.pointer import WORDS as CONTEXT_WORDS
from mutualrl.tasks.pointer import ExactMatchVerifier

# Keys and values, 16 per family (the first ``num_keys`` of each are used). Disjoint from each
# other and from the context words.
FACT_WORDS = {
    "alpha": (
        "apple bread chair table glass stone river cloud grass horse mouse sheep lion bear "
        "wolf duck snake salt sugar rice corn bean soup meat cheese butter honey water juice "
        "coffee tea wine"
    ).split(),
    "beta": (
        "beer coat shoe sock ring belt bag cap shirt dress north south east west green black "
        "white brown pink gray one two three four five six seven eight nine ten piano drum"
    ).split(),
    "gamma": (
        "guitar iron copper silver steel wood paper cotton wool silk hill lake sea ocean island "
        "forest desert valley field farm bank shop school church hotel office market garden "
        "park street army navy"
    ).split(),
}
MAX_KEYS = 16
HELDOUT_SHARE = 8  # one prompt in 8 is held out


def table(family: str, num_keys: int) -> dict[str, str]:
    """The family's facts: key -> value (the first half of its words are keys, the rest values)."""
    words = FACT_WORDS[family]
    return dict(zip(words[:MAX_KEYS][:num_keys], words[MAX_KEYS:][:num_keys], strict=True))


def _is_heldout(text: str) -> bool:
    digest = hashlib.blake2b(text.encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") % HELDOUT_SHARE == 0


class LookupTask:
    def __init__(
        self, families: Sequence[str] = ("alpha", "beta"), num_words: int = 4, num_keys: int = 8
    ) -> None:
        unknown = [f for f in families if f not in FACT_WORDS]
        if unknown:
            raise TaskError(
                f"task.families: unknown lookup families {unknown}; known: {sorted(FACT_WORDS)}"
            )
        if not 2 <= num_words <= len(CONTEXT_WORDS) + 1:
            raise TaskError(
                f"task.num_words must be in [2, {len(CONTEXT_WORDS) + 1}], got {num_words}"
            )
        if not 1 <= num_keys <= MAX_KEYS:
            raise TaskError(f"task.num_keys must be in [1, {MAX_KEYS}], got {num_keys}")
        self.families = tuple(families) or ("alpha", "beta")
        self.num_words, self.num_keys = num_words, num_keys
        self.tables = {f: table(f, num_keys) for f in self.families}
        self.verifier = ExactMatchVerifier()

    def sample(
        self, rng: np.random.Generator, n: int, split: Split, families: Sequence[str] | None = None
    ) -> list[Prompt]:
        if split == "validation":
            raise TaskError(
                "the lookup task has no validation split (train and held-out only); "
                "use the arithmetic task or a data file with rows marked 'validation'"
            )
        fams = tuple(families) if families else self.families
        unknown = [f for f in fams if f not in self.tables]
        if unknown:
            raise TaskError(
                f"lookup families {unknown} are not in this task's {list(self.families)}"
            )
        start = int(rng.integers(len(fams)))  # stratified, as in the pointer task
        out: list[Prompt] = []
        while len(out) < n:
            family = fams[(start + len(out)) % len(fams)]
            keys = list(self.tables[family])
            key = keys[int(rng.integers(len(keys)))]
            context = [
                CONTEXT_WORDS[i]
                for i in rng.choice(len(CONTEXT_WORDS), self.num_words - 1, replace=False)
            ]
            text = f"{' '.join([*context, key])} ="
            if _is_heldout(text) != (split == "heldout"):
                continue
            out.append(Prompt(text=text, answer=" " + self.tables[family][key], family=family))
        return out

    def demonstration(self, prompt: Prompt) -> str:
        return prompt.answer


@TASKS.register("lookup")
def _make_lookup(cfg) -> LookupTask:
    return LookupTask(
        families=cfg.families or ("alpha", "beta"), num_words=cfg.num_words, num_keys=cfg.num_keys
    )
