"""Wire throughput and size of the experience exchange against pickle+zstd and JSON+zstd.

Same data for every format: 64 realistic rollouts (1k-4k tokens each, int32 token ids drawn
Zipf-like from a 129k vocabulary, float32 behaviour log-probs mostly near 0, English-like text
of ~4 characters a token). All formats use zstd level 3.

- ``mutualrl``: envelopes -> msgpack -> checksummed zstd frame; decode validates every record
  against its type (msgspec typed decoding plus ``Rollout.__post_init__``).
- ``pickle_dicts``: what a loop would naively ship -- dicts with token ids and log-probs as lists.
- ``pickle_structs``: pickle of the very same ``Rollout`` objects (bytes arrays), no validation.
- ``json_dicts``: stdlib ``json`` of the dicts.

    pytest benchmarks/bench_exchange.py                     # pytest-benchmark tables
    python benchmarks/bench_exchange.py --json out.json     # medians, spreads, ratios as JSON
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zstandard

from mutualrl.exchange import Delivery, Rollout
from mutualrl.exchange.framing import HEADER_SIZE
from mutualrl.exchange.wire import FrameCodec
from mutualrl.provenance import git_commit, machine_info, time_calls

N_ROLLOUTS = 64
LEVEL = 3
_WORDS = (
    "the of and to in is that for it as with was on be by this are or from at which an "
    "we can if not number sum each then so answer first last step total two three four "
    "five value equation result let therefore since because compute check prime list "
    "word letter count order digit carry add subtract multiply divide remainder x y n "
    "problem solution given find show follows hence thus case both only more than less "
    "equal greater between after before again final"
).split()


def make_rollouts(n: int = N_ROLLOUTS, seed: int = 0) -> list[Rollout]:
    """Deterministic realistic rollouts (see module docstring)."""
    rng = np.random.default_rng(seed)
    zipf_p = 1.0 / np.arange(1, len(_WORDS) + 1)
    zipf_p /= zipf_p.sum()
    out = []
    for i in range(n):
        n_tok = int(rng.integers(1024, 4097))
        words = rng.choice(_WORDS, size=n_tok * 4 // 5, p=zipf_p)  # ~5 chars/word incl. space
        text = " ".join(words)
        prompt = f"Problem {i}: " + " ".join(rng.choice(_WORDS, size=40, p=zipf_p))
        ids = np.minimum(rng.zipf(1.2, size=n_tok), 129_279).astype(np.int32)
        logprobs = -rng.exponential(0.35, size=n_tok).astype(np.float32)
        out.append(
            Rollout.create(
                prompt=prompt,
                completion=text,
                producer=f"policy{i % 2}",
                tokenizer_id="deepseek-v3:129280",
                token_ids=ids,
                logprobs=logprobs,
                reward=float(i % 3 == 0),
                verifier_id="exact_match",
                policy_version=i // 8,
                finish_reason="stop" if i % 5 else "length",
                family="arith",
                group_index=i // 8,
                sample_index=i % 8,
            )
        )
    return out


def as_dict(r: Rollout) -> dict:
    d = msgspec.structs.asdict(r)
    d["token_ids"] = r.token_array.tolist()
    d["logprobs"] = r.logprob_array.tolist()
    return d


@dataclass
class Format:
    name: str
    encode: Callable[[], bytes]
    decode: Callable[[bytes], list]
    raw_bytes: int  # serialized size before compression


def make_formats(rollouts: list[Rollout]) -> dict[str, Format]:
    """The four contenders, each closed over the same rollouts."""
    deliveries = [
        Delivery(
            kind="rollout", producer=r.producer, producer_version=r.policy_version, seq=i, record=r
        )
        for i, r in enumerate(rollouts)
    ]
    dicts = [as_dict(r) for r in rollouts]
    codec = FrameCodec(level=LEVEL)
    cctx = zstandard.ZstdCompressor(level=LEVEL)
    dctx = zstandard.ZstdDecompressor()

    def mutualrl_decode(data: bytes) -> list:
        return [d.record for d in codec.decode(data)]

    formats = [
        Format(
            "mutualrl",
            lambda: codec.encode(deliveries),
            mutualrl_decode,
            len(dctx.decompress(codec.encode(deliveries)[HEADER_SIZE:])),
        ),
        Format(
            "pickle_dicts",
            lambda: cctx.compress(pickle.dumps(dicts, protocol=5)),
            lambda b: pickle.loads(dctx.decompress(b)),
            len(pickle.dumps(dicts, protocol=5)),
        ),
        Format(
            "pickle_structs",
            lambda: cctx.compress(pickle.dumps(rollouts, protocol=5)),
            lambda b: pickle.loads(dctx.decompress(b)),
            len(pickle.dumps(rollouts, protocol=5)),
        ),
        Format(
            "json_dicts",
            lambda: cctx.compress(json.dumps(dicts).encode()),
            lambda b: json.loads(dctx.decompress(b)),
            len(json.dumps(dicts).encode()),
        ),
    ]
    return {f.name: f for f in formats}


# ---------------------------------------------------------------- pytest-benchmark mode


@pytest.fixture(scope="module")
def formats() -> dict[str, Format]:
    return make_formats(make_rollouts())


@pytest.mark.parametrize("name", ["mutualrl", "pickle_dicts", "pickle_structs", "json_dicts"])
def test_encode(benchmark, formats, name) -> None:
    fmt = formats[name]
    benchmark.group = "encode+compress 64 rollouts"
    data = benchmark(fmt.encode)
    benchmark.extra_info["compressed_bytes_per_rollout"] = len(data) / N_ROLLOUTS


@pytest.mark.parametrize("name", ["mutualrl", "pickle_dicts", "pickle_structs", "json_dicts"])
def test_decode(benchmark, formats, name) -> None:
    fmt = formats[name]
    benchmark.group = "decompress+decode 64 rollouts"
    data = fmt.encode()
    out = benchmark(fmt.decode, data)
    assert len(out) == N_ROLLOUTS


# ---------------------------------------------------------------- script mode


def _summary(times: list[float], n_bytes: int) -> dict:
    q1, med, q3 = np.percentile(times, [25, 50, 75])
    return {
        "median_s": med,
        "iqr_s": q3 - q1,
        "min_s": min(times),
        "stdev_s": statistics.stdev(times),
        "records_per_s": N_ROLLOUTS / med,
        "mb_per_s_uncompressed": n_bytes / med / 1e6,
    }


def _machine() -> dict:
    return {
        **machine_info(
            msgspec=msgspec.__version__, zstandard=zstandard.__version__, numpy=np.__version__
        ),
        "git_commit": git_commit(),
    }


def run_all(repeat: int) -> dict:
    rollouts = make_rollouts()
    formats = make_formats(rollouts)
    results = {}
    for name, fmt in formats.items():
        data = fmt.encode()
        results[name] = {
            "compressed_bytes_per_rollout": len(data) / N_ROLLOUTS,
            "uncompressed_bytes_per_rollout": fmt.raw_bytes / N_ROLLOUTS,
            "encode": _summary(time_calls(fmt.encode, repeat), fmt.raw_bytes),
            "decode": _summary(
                time_calls(lambda fmt=fmt, data=data: fmt.decode(data), repeat), fmt.raw_bytes
            ),
        }
    ours = results["mutualrl"]
    ratios = {
        f"{op}_speedup_vs_{peer}": results[peer][op]["median_s"] / ours[op]["median_s"]
        for peer in results
        if peer != "mutualrl"
        for op in ("encode", "decode")
    }
    ratios.update(
        {
            f"size_ratio_{peer}_over_mutualrl": results[peer]["compressed_bytes_per_rollout"]
            / ours["compressed_bytes_per_rollout"]
            for peer in results
            if peer != "mutualrl"
        }
    )
    tokens = int(sum(r.num_tokens for r in rollouts))
    return {
        "benchmark": "exchange_wire",
        "config": {"rollouts": N_ROLLOUTS, "tokens": tokens, "zstd_level": LEVEL, "repeat": repeat},
        "machine": _machine(),
        "results": results,
        "ratios": ratios,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write results here")
    parser.add_argument("--repeat", type=int, default=21)
    args = parser.parse_args(argv)
    report = run_all(args.repeat)
    for name, r in report["results"].items():
        print(
            f"{name:15s} enc {r['encode']['median_s'] * 1e3:7.2f} ms "
            f"({r['encode']['records_per_s']:8.0f} rec/s)  dec {r['decode']['median_s'] * 1e3:7.2f}"
            f" ms ({r['decode']['records_per_s']:8.0f} rec/s, "
            f"{r['decode']['mb_per_s_uncompressed']:6.0f} MB/s)  "
            f"{r['compressed_bytes_per_rollout']:8.0f} B/rollout"
        )
    for key, value in report["ratios"].items():
        print(f"{key:40s} {value:6.2f}x")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
