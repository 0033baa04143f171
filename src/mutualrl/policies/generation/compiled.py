"""Compiled decoding for the torch sampler (``grpo.generation_compile = "decode"``).

The one-token forward over a static KV cache runs through ``torch.compile`` (inductor; on CUDA in
mode "reduce-overhead", i.e. CUDA graphs), as transformers' ``generate`` does with a static
cache. A compiled graph is specialised to its shapes, so shapes are bucketed to bound how often
it compiles: the batch is padded up to a power of two with dummy rows (a copy of the first
prompt; their tokens are dropped and they draw nothing from the generator), and prompts are
left-padded (attention mask 0) up to a power of two of at least ``PROMPT_FLOOR`` tokens. A
bucket is (padded rows, padded prompt + new tokens); each keeps its own cache object, reset per
call, so a graph's inputs keep their addresses (what CUDA graphs replay into).

A model with sliding-window layers (Gemma 3) compiles once per bucket too while its sequences fit
the window; a bucket whose sequences outgrow it decodes eagerly, with a warning, rather than
compile at every step (torch.py's ``_UniformStaticCache`` says why).

The prompt's forward (prefill) stays eager: it runs once per call, at varying lengths.
Sampling stays eager too, on the real rows only: the draws come from the policy's generator in
the same order as the eager sampler's, and the log-probs are those of the distribution sampled
from. The decode step's attention mask is the cache's full length, written in place one column
a step, so its shape never changes (a mask that grows by one column would compile per step).

Graphs compiled are counted by the backend itself (one call per graph dynamo hands it), and the
seconds of decode steps that compiled are kept apart from steady-state ones (``stats``).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import StaticCache

PROMPT_FLOOR = 16  # smallest prompt bucket: short prompts of different lengths share one graph


def bucket(n: int, floor: int = 1) -> int:
    """The smallest power of two >= max(n, floor): at most log2(max) buckets per dimension."""
    return 1 << (max(n, floor) - 1).bit_length()


def compile_mode(device: torch.device) -> str:
    """CUDA graphs where there is a GPU (per-step launch overhead is what decoding pays); plain
    inductor kernels on CPU, where CUDA graphs do not exist."""
    return "reduce-overhead" if device.type == "cuda" else "default"


class CompiledDecoder:
    """One model's compiled decode step, its per-bucket static caches and its counters."""

    def __init__(
        self,
        model,
        cache_key: str,
        device: torch.device,
        make_cache: Callable[[torch.nn.Module, int], StaticCache],
    ) -> None:
        self.model, self.cache_key, self.device = model, cache_key, device
        self.make_cache = make_cache  # (model, length) -> a static cache
        self.mode = compile_mode(device)
        self.caches: dict[tuple[int, int], StaticCache] = {}
        self.graphs = 0  # graphs compiled so far (backend calls)
        self.eager_buckets: set[int] = set()  # caches that outgrow a sliding window (warned)
        self.pending = {"compile_s": 0.0, "decode_s": 0.0, "decode_steps": 0, "decode_tokens": 0}
        self.step = torch.compile(self._forward, backend=self._compile, dynamic=False)

    def _compile(self, gm, example_inputs):
        """Inductor at ``self.mode``'s options, counted (``torch.compile(mode=...)`` does the same
        through a wrapper that cannot count)."""
        from torch._inductor import list_mode_options
        from torch._inductor.compile_fx import compile_fx

        self.graphs += 1
        return compile_fx(gm, example_inputs, config_patches=list_mode_options(self.mode))

    def _forward(self, input_ids, attention_mask, position_ids, cache_position, cache):
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache_position=cache_position,
            use_cache=True,
            **{self.cache_key: cache},
        )
        return out.logits

    def stats(self) -> dict[str, float]:
        """What decoding cost since the last call: seconds of steps that compiled, seconds and
        tokens/s of the others (steady state), and the graphs compiled so far."""
        p, self.pending = self.pending, dict.fromkeys(self.pending, 0)
        p["decode_s"] = float(p["decode_s"])
        out = {
            "generation/compile_s": float(p["compile_s"]),
            "generation/decode_s": p["decode_s"],
            "generation/compiled_graphs": float(self.graphs),
        }
        if p["decode_s"] > 0:
            out["generation/decode_tokens_per_s"] = p["decode_tokens"] / p["decode_s"]
        return out

    def prepare(self, ids, attn, pos, new_tokens: int):
        """Pad (B, P) prompts to their bucket: (ids, attn, pos) of (Bb, Pb), the (Bb, Pb + N)
        attention mask the decode steps write into, and the bucket's cache, reset."""
        B, P = ids.shape
        Bb, Pb = bucket(B), bucket(P, PROMPT_FLOOR)
        rows = torch.cat([torch.arange(B), torch.zeros(Bb - B, dtype=torch.long)])  # dummies: row 0

        def pad(x):  # dummy rows below, then pad columns (mask 0) on the left
            return torch.nn.functional.pad(x[rows.to(x.device)], (Pb - P, 0), value=0)

        ids, attn, pos = pad(ids), pad(attn), pad(pos)
        mask = torch.zeros((Bb, Pb + new_tokens), dtype=attn.dtype, device=attn.device)
        mask[:, :Pb] = attn
        key = (Bb, Pb + new_tokens)
        cache = self.caches.get(key)
        if cache is None:
            cache = self.caches[key] = self.make_cache(self.model, Pb + new_tokens)
        else:
            cache.reset()
        return ids, attn, pos, mask, cache

    def decode(self, tokens, mask, next_pos, at: int, cache, real_rows: int) -> torch.Tensor:
        """(Bb, 1) tokens at cache position ``at`` -> (real_rows, V) fp32 logits of the next."""
        mask[:, at] = 1
        position = torch.full((1,), at, device=self.device, dtype=torch.long)
        if self.mode == "reduce-overhead":  # a new replay: earlier outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        before, t0 = self.graphs, time.perf_counter()
        step = self._forward if self._eager(cache) else self.step
        logits = step(tokens, mask, next_pos, position, cache)[:real_rows, -1].float()
        if self.mode == "reduce-overhead":  # the graph's output buffer is reused next replay
            logits = logits.clone()
        return self._timed(logits, before, t0, real_rows)

    def _eager(self, cache) -> bool:
        """Whether this bucket decodes eagerly: its sequences outgrow a sliding window, whose layer
        counts its tokens in a Python int that a compiled step would recompile on at every step
        (torch.py's ``_UniformStaticCache``). Warned once per bucket."""
        sliding = getattr(cache, "sliding", [])
        if sliding and id(cache) not in self.eager_buckets:
            self.eager_buckets.add(id(cache))
            warnings.warn(
                f"grpo.generation_compile: a sequence of up to {cache.length} tokens "
                f"(prompt bucket + new tokens) outgrows the sliding window of layers {sliding}; "
                "these calls decode eagerly (compiled, they would recompile at every step)",
                stacklevel=3,
            )
        return bool(sliding)

    def _timed(self, logits, before: int, t0: float, real_rows: int) -> torch.Tensor:
        if self.device.type == "cuda":  # kernels run asynchronously: time them, not launches
            torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t0
        if self.graphs > before:
            self.pending["compile_s"] += dt
        else:
            self.pending["decode_s"] += dt
            self.pending["decode_steps"] += 1
            self.pending["decode_tokens"] += real_rows
        return logits
