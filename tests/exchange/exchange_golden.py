"""The records frozen in ``golden/v1_*.bin`` (schema 1.0), and the script that wrote them.

The golden files are written once per schema MAJOR and never regenerated: they are what old runs
look like on disk, and the tests prove today's reader still reads them. Run
``python tests/exchange/exchange_golden.py`` only to add files for a new version.
"""

from __future__ import annotations

import sys
from pathlib import Path

from mutualrl.exchange import Delivery, GroupStats, Rollout, VerifiedSuccess, Watermark, prompt_id
from mutualrl.exchange.wire import FrameCodec

GOLDEN_DIR = Path(__file__).parent / "golden"
PROMPT = "first of cat dog sun tree:"


def v1_deliveries() -> list[Delivery]:
    """One record of every built-in kind, from two producers."""
    pid = prompt_id(PROMPT)
    rollout = Rollout.create(
        prompt=PROMPT,
        completion=" cat",
        producer="llama-a",
        tokenizer_id="sp32k:0f1e",
        token_ids=[5, 6094, 2],
        logprobs=[-0.25, -1.5, -0.125],
        reward=1.0,
        verifier_id="exact_match",
        policy_version=3,
        finish_reason="stop",
        family="first",
        group_index=0,
        sample_index=1,
    )
    stats = GroupStats.from_rewards(
        prompt_id=pid, producer="qwen-b", policy_version=2, rewards=[1.0, 0.0, 0.0, 1.0]
    )
    success = VerifiedSuccess(
        prompt_id=pid,
        prompt=PROMPT,
        completion=" cat",
        reward=1.0,
        verifier_id="exact_match",
        verifier_version="1",
        source="llama-a",
        policy_version=3,
        family="first",
    )
    mark = Watermark(producer="qwen-b", version=2)
    items = [
        ("rollout", "llama-a", 3, rollout),
        ("group_stats", "qwen-b", 2, stats),
        ("verified_success", "llama-a", 3, success),
        ("watermark", "qwen-b", 2, mark),
    ]
    return [
        Delivery(kind=k, producer=p, producer_version=v, seq=i, record=r)
        for i, (k, p, v, r) in enumerate(items)
    ]


def main() -> int:
    path = GOLDEN_DIR / "v1_all_kinds.bin"
    if path.exists():
        print(f"{path} exists; golden files are never rewritten", file=sys.stderr)
        return 1
    GOLDEN_DIR.mkdir(exist_ok=True)
    path.write_bytes(FrameCodec(level=19).encode(v1_deliveries()))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
