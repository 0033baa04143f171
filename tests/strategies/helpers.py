"""Helpers for the strategy tests: hand-built samples, deliveries and strategy contexts.

Everything here is model-free: samples and exchange deliveries are built by hand, the receiver's
``sequence_logprobs`` is a stub returning chosen values, and only THL runs for real (through
``Retokenizer`` on the packaged tokenizers, whose byte tables come from the session cache).
"""

from __future__ import annotations

import numpy as np
import torch

from mutualrl.config import GRPOConfig
from mutualrl.exchange import Delivery, GroupStats, Rollout
from mutualrl.exchange import prompt_id as hash_prompt
from mutualrl.policies.policy import Sample
from mutualrl.retokenize import Retokenizer
from mutualrl.strategies import StrategyContext
from mutualrl.tasks.base import Prompt

# Receiver / peer of the hand-built tests: different tokenizer families, as in the default run.
RECV, PEER = "llama-mistral", "qwen-deepseek"
TOKENIZER_OF = {RECV: "mistral-v1", PEER: "deepseek-v3"}

PA = Prompt(text="first: cat dog sun tree =", answer=" cat", family="first")
PB = Prompt(text="last: red blue car fish =", answer=" fish", family="last")
PC = Prompt(text="first: king ship gold door =", answer=" king", family="first")
PD = Prompt(text="last: hand road wind fire =", answer=" fire", family="last")


def sample(
    prompt: Prompt,
    group: int,
    reward: float,
    *,
    ids=(5, 6, 2),
    lps=(-0.5, -0.25, -0.125),
    text=" x",
    finish="stop",
) -> Sample:
    return Sample(
        prompt=prompt,
        prompt_ids=(1, 100 + group),
        completion_ids=tuple(ids),
        logprobs=tuple(lps),
        text=text,
        finish_reason=finish,
        group=group,
        reward=reward,
    )


def group(prompt: Prompt, g: int, rewards, **kw) -> list[Sample]:
    return [
        sample(prompt, g, r, ids=(5 + i, 2), lps=(-0.1 * (i + 1), -0.05), **kw)
        for i, r in enumerate(rewards)
    ]


def peer_tokens(handle, text: str, stop: bool = True) -> list[int]:
    ids = handle.tokenizer(text, add_special_tokens=False)["input_ids"]
    return list(ids) + ([handle.tokenizer.eos_token_id] if stop else [])


def rollout(
    producer: str,
    handle,
    prompt: Prompt,
    completion: str,
    reward: float,
    *,
    logprob_total: float = -1.0,
    finish: str = "stop",
    seq: int = 0,
) -> Delivery:
    """A peer's rollout as the exchange delivers it; its log-probs sum to ``logprob_total``."""
    ids = peer_tokens(handle, completion, finish == "stop")
    lps = [logprob_total] + [0.0] * (len(ids) - 1)
    rec = Rollout.create(
        prompt=prompt.text,
        completion=completion,
        producer=producer,
        tokenizer_id=handle.fingerprint,
        token_ids=ids,
        logprobs=lps,
        reward=float(reward),
        verifier_id="exact-match",
        policy_version=0,
        finish_reason=finish,
        family=prompt.family,
    )
    return Delivery(kind="rollout", producer=producer, producer_version=0, seq=seq, record=rec)


def stats(producer: str, prompt: Prompt, rewards, seq: int = 0) -> Delivery:
    rec = GroupStats.from_rewards(
        prompt_id=hash_prompt(prompt.text), producer=producer, policy_version=0, rewards=rewards
    )
    return Delivery(kind="group_stats", producer=producer, producer_version=0, seq=seq, record=rec)


def encoder(handle):
    """The receiver's prompt format, as ``Policy.encode_prompt``: BOS (if any) + the text's ids."""
    tok = handle.tokenizer

    def encode(text: str) -> tuple[int, ...]:
        bos = tok.bos_token_id
        return tuple(
            ([bos] if bos is not None else []) + tok(text, add_special_tokens=False)["input_ids"]
        )

    return encode


class LogprobStub:
    """``sequence_logprobs`` returning chosen totals, recording what it was asked."""

    def __init__(self, values):
        self.values = list(values)
        self.calls: list[tuple[list, list]] = []

    def __call__(self, prompts, completions):
        self.calls.append((list(prompts), list(completions)))
        assert len(prompts) == len(completions) <= len(self.values)
        return torch.tensor(self.values[: len(prompts)], dtype=torch.float32)


def refuse(prompts, completions):
    raise AssertionError("sequence_logprobs must not be called here")


def make_ctx(
    handles: dict,
    peer_experience=(),
    *,
    grpo: GRPOConfig | None = None,
    step: int = 0,
    logprobs: dict | None = None,
    max_length: int = 8,
) -> StrategyContext:
    names = list(handles)
    return StrategyContext(
        step=step,
        grpo=grpo or GRPOConfig(num_generations=2),
        policy_names=names,
        rng=np.random.default_rng([0, 4, step]),
        encode_prompt={n: encoder(h) for n, h in handles.items()},
        sequence_logprobs=logprobs or {n: refuse for n in names},
        retokenizers={n: Retokenizer(h, max_length=max_length) for n, h in handles.items()},
        tokenizers={h.fingerprint: h for h in handles.values()},
        peer_experience=list(peer_experience),
    )


def zscores(rewards, eps: float = 1e-4, ddof: int = 0) -> np.ndarray:
    """Hand z-score of one group: population std (``ddof=1``: sample std), TRL's epsilon, exact 0
    for a constant group."""
    r = np.asarray(rewards, dtype=np.float64)
    std = r.std(ddof=ddof)
    return np.zeros_like(r) if std == 0 else (r - r.mean()) / (std + eps)
