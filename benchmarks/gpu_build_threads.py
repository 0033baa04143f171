"""Where a GPU policy's build time goes, and whether two policies generating in threads of one
process overlap on the card (the lock-step executor's case), with one CUDA stream or a stream per
thread.

Builds each policy of ``--config`` on ``cuda`` under cProfile and prints its cumulative and
internal-time tables (random initialisation, tokenizer load, moves to the device); then times each
policy's ``generate`` (8 prompts x 8 completions x ``--tokens`` new tokens) alone after a warm-up,
and both at once in two threads, on the default stream and on a stream each, ``--repeats`` times.
The last line is ``PROBE {json}`` (and ``--json`` writes the same object).

    python benchmarks/gpu_build_threads.py [--config configs/gpu1-random-1b.toml] [--tokens 64]

Needs a CUDA GPU and the project importable (with the ``qwen`` and ``llama`` extras for the
default config). ``--device cpu`` runs the same build and timings on the CPU (no streams there), for
checking the script on a small config.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import threading
import time


def _print_profile(prof: cProfile.Profile, title: str) -> None:
    for order, rows in (("cumulative", 35), ("tottime", 20)):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(order).print_stats(rows)
        print(f"==== {title}, by {order}\n" + s.getvalue(), flush=True)


def build_profiled(cfg, device: str, sync, out: dict) -> dict:
    """Each policy of ``cfg`` built on ``device`` under cProfile (tables printed, seconds in
    ``out``): name -> Policy."""
    from mutualrl.policies.policy import Policy
    from mutualrl.run.build import optimizer_steps

    pols = {}
    for i, p in enumerate(cfg.policies):
        prof = cProfile.Profile()
        t = time.perf_counter()
        prof.enable()
        pols[p.name] = Policy(
            p,
            cfg.grpo,
            seed=i,
            device=device,
            total_steps=optimizer_steps(cfg),
            training=cfg.training,
        )
        sync()
        prof.disable()
        out[f"build_{p.name}_s"] = time.perf_counter() - t
        _print_profile(prof, f"build {p.name}: {out[f'build_{p.name}_s']:.1f} s")
    return pols


def time_generation(pols: dict, tokens: int, repeats: int, cuda: bool, sync, out: dict) -> None:
    """Each policy's ``generate`` alone after a warm-up, then all at once in threads (default
    stream; on CUDA also a stream each), ``repeats`` times; seconds into ``out``."""
    import torch

    from mutualrl.tasks.base import Prompt

    prompts = [
        Prompt(
            text=f"Question {k}: which word comes first in alpha beta gamma delta?",
            answer="alpha",
            family="first",
        )
        for k in range(8)
    ]

    def gen(pol, stream=None) -> None:
        if stream is None:
            pol.generate(prompts, 8, tokens, 1.0)
        else:
            with torch.cuda.stream(stream):
                pol.generate(prompts, 8, tokens, 1.0)
                stream.synchronize()
        sync()

    def both(streams) -> float:
        ths = [
            threading.Thread(target=gen, args=(pol, s)) for pol, s in zip(pols.values(), streams)
        ]
        t = time.perf_counter()
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        return time.perf_counter() - t

    for pol in pols.values():
        gen(pol)  # warm-up
    alone = {}
    for name, pol in pols.items():
        t = time.perf_counter()
        gen(pol)
        alone[name] = time.perf_counter() - t
    out["gen_alone_s"] = alone
    for _ in range(repeats):
        out.setdefault("gen_threads_default_stream_s", []).append(both([None] * len(pols)))
        if cuda:
            out.setdefault("gen_threads_own_streams_s", []).append(
                both([torch.cuda.Stream() for _ in pols])
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/gpu1-random-1b.toml")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per completion")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", help="also write the result here")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    args = ap.parse_args()

    t0 = time.perf_counter()
    import torch

    t_torch = time.perf_counter() - t0
    # timed with the imports: what the build and the generation below use
    import mutualrl.policies.policy  # noqa: F401
    import mutualrl.run.build  # noqa: F401
    import mutualrl.tasks.base  # noqa: F401
    from mutualrl.config import load_config

    t_imp = time.perf_counter() - t0
    out: dict = {"import_torch_s": t_torch, "import_all_s": t_imp}
    cuda = args.device.startswith("cuda")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    torch.zeros(1, device=args.device)
    out["cuda_init_s"] = time.perf_counter() - t0 - t_imp  # the device's first tensor
    pols = build_profiled(load_config(args.config), args.device, sync, out)
    time_generation(pols, args.tokens, args.repeats, cuda, sync, out)
    out["max_new_tokens"] = args.tokens
    out["device"] = args.device
    print("PROBE " + json.dumps(out), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
