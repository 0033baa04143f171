"""How long a short call takes right after other work, against back to back, on this machine.

The retokenization benchmark pairs our aligner (about 0.5 ms for the corpus) with TRL's walk
(about 10 ms). Alternated call by call, ours always runs right after 10 ms of TRL's Python. This
script times the same ``align_many`` of the corpus (one tokenizer pair) back to back, and right
after each of: TRL's walk over the same offsets, a 10 ms ``time.sleep``, and 10 ms of a Python
loop that touches no arrays. If a sleep slows the next call as much as TRL's walk does, the
slowdown belongs to the machine (a shared VM's core and caches go to others while we wait),
not to what TRL's walk leaves in memory; ``provenance.time_turns`` is the benchmark's answer.

    python benchmarks/cold_call.py --json benchmarks/results/cold_call.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from mutualrl.bench import baselines
from mutualrl.bench.retokenize import PairData, _offsets, load_corpus
from mutualrl.provenance import collector_paused, git_commit, machine_info
from mutualrl.retokenize import Retokenizer, load_tokenizer
from mutualrl.retokenize.align import align_batch, align_many


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", default="deepseek-v3")
    ap.add_argument("--target", default="bert-wordpiece")
    ap.add_argument("--repeats", type=int, default=41, help="timed calls per condition")
    ap.add_argument("--gap-ms", type=float, default=10.0, help="length of the sleep and the loop")
    ap.add_argument("--json", type=Path, help="write the results here")
    a = ap.parse_args(argv)
    # glibc's allocator defaults, as `mutualrl bench retokenize` runs (malloc.py)
    texts = load_corpus()
    d = PairData.build(
        Retokenizer(load_tokenizer(a.source), cache_size=0),
        Retokenizer(load_tokenizer(a.target), cache_size=0),
        texts,
    )
    trl = baselines.trl_align_fn()
    s_off, t_off = [_offsets(e) for e in d.src_ends], [_offsets(e) for e in d.tgt_ends]
    gap = a.gap_ms / 1e3
    before = {
        "back to back": None,
        f"after a {a.gap_ms:g} ms sleep": lambda: time.sleep(gap),
        f"after a {a.gap_ms:g} ms Python loop": lambda: _spin(gap),
    }
    if trl is not None:
        before["after TRL's walk"] = lambda: [trl(x, y) for x, y in zip(s_off, t_off)]
    calls = {
        "align_many": lambda: align_many(d.src_ends, d.tgt_ends, d.totals),
        "align_batch": lambda: align_batch(d.src_ends, d.tgt_ends, d.totals),
    }
    rows = []
    for call_name, call in calls.items():
        call()
        for label, pre in before.items():
            times = []
            with collector_paused():  # as the benchmark's timers (provenance.time_calls)
                for _ in range(a.repeats):
                    if pre is not None:
                        pre()
                    start = time.perf_counter()
                    call()
                    times.append(time.perf_counter() - start)
            rows.append(
                {
                    "call": call_name,
                    "condition": label,
                    "median_ms": statistics.median(times) * 1e3,
                    "min_ms": min(times) * 1e3,
                    "max_ms": max(times) * 1e3,
                }
            )
    for call_name in calls:
        base = next(r["median_ms"] for r in rows if r["call"] == call_name)
        for r in rows:
            if r["call"] == call_name:
                r["over_back_to_back"] = r["median_ms"] / base
                print(
                    f"{call_name:12s} {r['condition']:28s} {r['median_ms']:7.3f} ms "
                    f"({r['over_back_to_back']:.2f}x)"
                )
    result = {
        "benchmark": "cold_call",
        "commit": git_commit(),
        "machine": machine_info(),
        "pair": [a.source, a.target],
        "texts": len(texts),
        "repeats": a.repeats,
        "gap_ms": a.gap_ms,
        "rows": rows,
    }
    if a.json:
        a.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
