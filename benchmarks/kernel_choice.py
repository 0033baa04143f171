"""Which implementation each loop of the retokenizer's batch path keeps: numpy passes or numba.

The batch path had four loops written twice, as whole-batch numpy passes and as numba loops,
chosen at run time by batch size. To keep one of each, this script times both, per call and
alternating in rounds in one process, at two batch sizes: an exchange step's (32 completions of
64 characters, about 1,300 tokens on both sides) and the benchmark corpus (170 texts, about
40,000 tokens), after a warm-up; and numba's first use in a fresh process (its import and loading
its cached machine code) against numpy's. The loops: the spelling check of lossless ids with
their byte ends (``spelled_ends``, deepseek-v3), the WordPiece fold and walk (``folded_ends``,
bert-wordpiece), the alignment with its per-text statistics (``align_flat``, deepseek-v3 against
mistral-v1).

Only a tree that still has both can time both: the script runs inside such a checkout
(``--tree``, made with ``git worktree add DIR COMMIT`` at the commit before the choice) with that
tree's sources first on the path:

    git worktree add /tmp/kernels-before 9504352
    python benchmarks/kernel_choice.py --tree /tmp/kernels-before \\
        --json benchmarks/results/kernels.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

SMALL = (32, 64)  # texts, characters each: an exchange step's completions
ROUNDS = 7


def _cases(texts: list[str]) -> tuple[dict, int]:
    from mutualrl.retokenize import Retokenizer, load_tokenizer
    from mutualrl.retokenize.align import align_flat
    from mutualrl.retokenize.encoding import laid_ids, rust_encode, spelled_ends
    from mutualrl.retokenize.wordpiece import folded_ends

    datas = [t.encode() for t in texts]

    def laid(name):
        prof = Retokenizer(load_tokenizer(name), cache_size=0).profile
        return (prof, *laid_ids([e.ids for e in rust_encode(prof, texts)]))

    (ds, ds_flat, ds_sizes), (bert, b_flat, b_sizes), (mi, mi_flat, mi_sizes) = map(
        laid, ("deepseek-v3", "bert-wordpiece", "mistral-v1")
    )
    s_ends = spelled_ends(ds, ds_flat, ds_sizes, datas)[1]
    t_ends = spelled_ends(mi, mi_flat, mi_sizes, datas)[1]
    totals = np.array([len(d) for d in datas], dtype=np.int64)
    fns = {
        "spelled_ends": lambda: spelled_ends(ds, ds_flat, ds_sizes, datas),
        "folded_ends": lambda: folded_ends(bert, b_flat, b_sizes, texts, datas),
        "align_flat": lambda: align_flat(s_ends, ds_sizes, t_ends, mi_sizes, totals).statistics(),
    }
    return fns, int(ds_sizes.sum() + mi_sizes.sum())


def _per_call(fn, mode: str, reps: int) -> float:
    os.environ["MUTUALRL_KERNELS"] = mode
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def _spread(values: list[float], scale: float) -> dict:
    return {
        "median": scale * float(np.median(values)),
        "min": scale * min(values),
        "max": scale * max(values),
    }


def _small_texts() -> list[str]:
    from mutualrl.bench.retokenize import load_corpus

    n, chars = SMALL
    rng = np.random.default_rng(0)
    return [t[:chars] for t in rng.choice(load_corpus(), n, replace=False)]


def measure() -> dict:
    from mutualrl.bench.retokenize import load_corpus

    out: dict = {}
    for label, texts, reps in (
        ("exchange step", _small_texts(), 200),
        ("corpus", load_corpus(), 20),
    ):
        fns, tokens = _cases(texts)
        for name, fn in fns.items():
            for mode in ("numba", "numpy"):  # compiled, loaded and warm
                _per_call(fn, mode, 3)
            rounds: dict[str, list[float]] = {"numpy": [], "numba": []}
            for _ in range(ROUNDS):
                for mode in rounds:
                    rounds[mode].append(_per_call(fn, mode, reps))
            row = {m: _spread(v, 1e6) for m, v in rounds.items()}
            out.setdefault(name, {})[label] = {"texts": len(texts), "tokens": tokens, "us": row}
            print(
                f"{name:13s} {label:13s} {tokens:6d} tokens: numpy {row['numpy']['median']:8.1f}"
                f" us, numba {row['numba']['median']:8.1f} us",
                flush=True,
            )
    return out


def first_use(mode: str) -> float:
    """Seconds of the three loops' first call in this fresh process (inputs made with numpy)."""
    os.environ["MUTUALRL_KERNELS"] = "numpy"
    fns, _ = _cases(_small_texts())
    os.environ["MUTUALRL_KERNELS"] = mode
    t = time.perf_counter()
    for fn in fns.values():
        fn()
    took = time.perf_counter() - t
    assert ("mutualrl.retokenize.numba_loops" in sys.modules) == (mode == "numba")
    return took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", type=Path, help="a checkout that has both implementations")
    ap.add_argument("--json", type=Path, help="write the record here (a path outside --tree)")
    ap.add_argument("--first", choices=("numpy", "numba"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.first:
        print(first_use(args.first))
        return 0
    if args.tree is not None and os.environ.get("PYTHONPATH") != str(args.tree / "src"):
        env = {**os.environ, "PYTHONPATH": str(args.tree / "src")}
        cmd = [
            sys.executable,
            __file__,
            "--tree",
            str(args.tree),
            "--json",
            str(args.json.resolve()),
        ]
        return subprocess.run(cmd, env=env, cwd=args.tree).returncode
    import mutualrl.retokenize as retokenize
    from mutualrl.provenance import git_commit, machine_info

    print(f"timing the tree at {Path(retokenize.__file__).parents[3]}", flush=True)
    record: dict = {"benchmark": "kernel_choice", "commit": git_commit(), "loops": measure()}
    firsts: dict[str, list[float]] = {"numpy": [], "numba": []}
    for _ in range(4):  # fresh processes, the modes alternating
        for mode in firsts:
            done = subprocess.run(
                [sys.executable, __file__, "--first", mode],
                capture_output=True,
                text=True,
                check=True,
                env={**os.environ, "MUTUALRL_KERNELS": "numpy"},
            )
            firsts[mode].append(float(done.stdout.split()[-1]))
    record["first_use_s"] = {m: _spread(v, 1.0) for m, v in firsts.items()}
    print(f"first use in a fresh process (s): {record['first_use_s']}")
    record["machine"] = machine_info()
    record["command"] = " ".join(["python benchmarks/kernel_choice.py", *sys.argv[1:]])
    if args.json:
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
