"""Peak memory of a policy update on CPU: whole batch vs micro-batches vs chunked LM head.

Every configuration runs alone in a fresh Python subprocess (one after the other, never in
parallel) and reports its peak resident set size (``resource.getrusage(RUSAGE_SELF).ru_maxrss``)
twice: ``setup_rss_mb`` once its inputs exist, ``peak_rss_mb`` after the measured computation;
``delta_mb`` is what the computation itself added on top.

- ``logprobs``: log-probs + entropy of N completion positions through a 129,280-row LM head
  (DeepSeek-V3's vocabulary, hidden 64 as the default policy), forward and backward, the whole
  (N, V) logits at once (``token_logprobs``) vs ``chunked_token_logprobs`` (chunks of 256
  positions), at growing N (N = rows x 48).
- ``step``: one ``Policy.train_step`` of configs/tiny.toml's qwen-deepseek policy (129k
  vocabulary) on P prompts x 16 samples x 48 completion tokens, the whole batch at once vs
  micro-batches of 4 rows (``per_device_train_batch_size = 4``), and micro-batches of 16 rows
  whose 768 positions are chunked by 256 (``logprob_chunk_size = 256``).
  The whole 8-prompt batch peaks near 10 GB.

    python benchmarks/bench_update_memory.py --json update_memory.json [--part logprobs|step]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from mutualrl.provenance import git_commit, machine_info

ROOT = Path(__file__).resolve().parent.parent
VOCAB, HIDDEN, T = 129_280, 64, 48
LOGPROB_CASES = [
    dict(part="logprobs", rows=rows, chunk=chunk) for rows in (8, 32, 64) for chunk in (None, 256)
]
STEP_CASES = (
    [dict(part="step", prompts=8, micro=None, chunk=None)]
    + [dict(part="step", prompts=p, micro=4, chunk=None) for p in (4, 8, 16)]
    + [dict(part="step", prompts=p, micro=16, chunk=256) for p in (8, 16)]
)


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _logprobs_case(rows: int, chunk: int | None) -> dict:
    from mutualrl.grpo import chunked_token_logprobs, entropy_from_logprobs, token_logprobs

    g = torch.Generator().manual_seed(0)
    h = torch.randn(rows, T, HIDDEN, generator=g, requires_grad=True)
    w = (0.02 * torch.randn(VOCAB, HIDDEN, generator=g)).requires_grad_()
    targets = torch.randint(0, VOCAB, (rows, T), generator=g)
    setup = _rss_mb()
    t0 = time.perf_counter()
    if chunk is None:
        logp, logp_all = token_logprobs(h @ w.T, targets)
        with torch.no_grad():
            entropy_from_logprobs(logp_all)
    else:
        logp, _ = chunked_token_logprobs(h, w, None, targets, 1.0, chunk)
    logp.sum().backward()
    return dict(setup_rss_mb=setup, peak_rss_mb=_rss_mb(), seconds=time.perf_counter() - t0)


def _step_case(prompts: int, micro: int | None, chunk: int | None) -> dict:
    import msgspec

    from mutualrl.config import load_config
    from mutualrl.policies.batch import TrainBatch, TrainSequence
    from mutualrl.policies.policy import Policy

    cfg = load_config(ROOT / "configs" / "tiny.toml")
    pcfg = next(p for p in cfg.policies if p.tokenizer == "deepseek-v3")
    grpo = msgspec.structs.replace(
        cfg.grpo, max_completion_length=T, num_generations=16, prompts_per_step=prompts
    )
    training = msgspec.structs.replace(
        cfg.training, per_device_train_batch_size=micro, logprob_chunk_size=chunk
    )
    policy = Policy(pcfg, grpo, seed=0, training=training)
    g = torch.Generator().manual_seed(0)
    seqs = []
    for i in range(prompts * 16):
        ids = tuple(int(t) for t in torch.randint(10, VOCAB - 100, (T,), generator=g))
        old = tuple(float(x) for x in -12 + torch.randn(T, generator=g))
        seqs.append(
            TrainSequence(
                policy.encode_prompt(f"first: cat dog sun {i // 16} ="),
                ids,
                advantage=1.0 if i % 2 else -1.0,
                old_logprobs=old,
            )
        )
    batch = TrainBatch(sequences=tuple(seqs))
    setup = _rss_mb()
    stats = policy.train_step(batch)
    return dict(
        setup_rss_mb=setup,
        peak_rss_mb=_rss_mb(),
        seconds=stats["step_time_s"],
        rows=len(seqs),
        loss=stats["loss"],
    )


def child(spec: dict) -> dict:
    torch.set_num_threads(1)
    if spec["part"] == "logprobs":
        out = _logprobs_case(spec["rows"], spec["chunk"])
    else:
        out = _step_case(spec["prompts"], spec["micro"], spec["chunk"])
    out["delta_mb"] = out["peak_rss_mb"] - out["setup_rss_mb"]
    return {**spec, **out}


def run_all(cases: list[dict]) -> list[dict]:
    results = []
    for spec in cases:  # one at a time: the big ones must not overlap
        proc = subprocess.run(
            [sys.executable, __file__, "--child", json.dumps(spec)],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            results.append({**spec, "error": proc.stderr[-2000:]})
        else:
            results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--part", choices=["logprobs", "step", "all"], default="all")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    cases = {"logprobs": LOGPROB_CASES, "step": STEP_CASES, "all": LOGPROB_CASES + STEP_CASES}[
        args.part
    ]
    report = {
        "commit": git_commit(ROOT),
        "machine": machine_info(torch=torch.__version__),
        "vocab_size": VOCAB,
        "completion_tokens": T,
        "torch_threads": 1,
        "results": run_all(cases),
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
