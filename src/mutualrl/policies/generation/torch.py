"""The torch generation backend: a hand-written KV-cache sampling loop over the policy's model.

Not ``model.generate``: sampling draws from the policy's own ``torch.Generator`` (reproducible
when policies run concurrently in threads), and the log-probs are exactly those of the
distribution sampled from, computed by the trainer's own model, so no mismatch correction is
needed. The sampler and the trainer share the model: ``load_weights`` has nothing to move.
"""

from __future__ import annotations

import copy

import torch
from transformers import StaticCache, StopStringCriteria
from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

from mutualrl.policies.batch import collate
from mutualrl.policies.generation import GENERATION_BACKENDS, SamplingSettings
from mutualrl.policies.generation.compiled import CompiledDecoder
from mutualrl.policies.models import base_model
from mutualrl.policies.prefix import cache_keyword, prefill
from mutualrl.policies.samples import Sample
from mutualrl.policies.sampling import sample_tokens, truncate_logits, truncates


class TorchBackend:
    exact_logprobs = True
    # each distinct prompt is prefilled once for all its completions (policies.prefix.prefill:
    # the same draws); False: once per completion (benchmarks/bench_real_step.py compares them)
    share_prompts = True

    def __init__(
        self, view, learner, generator: torch.Generator, decoders: dict | None = None
    ) -> None:
        self.view, self.learner, self.generator = view, learner, generator
        self.cache_key = cache_keyword(learner.model)  # the learner keeps its model object
        self._frozen: FrozenWeights | None = None
        # model -> its CompiledDecoder (grpo.generation_compile), shared with the overlap
        # samplers this one makes, so their frozen copy compiles once, not once per step
        self._decoders: dict = {} if decoders is None else decoders
        self._stops: dict[tuple[str, ...], StopStringCriteria] = {}  # grpo.stop_strings, built once

    def load_weights(self, version: int) -> None:
        """Nothing to do: generation runs on the trainer's own parameters."""

    def overlap_sampler(self) -> TorchBackend:
        """A sampler over a copy of the weights as they are now, to draw from while the learner
        updates the originals (``Policy.update_and_generate``). The copy is made once and
        refreshed in place: overlapping costs one more set of weights, no allocation a step."""
        if self._frozen is None:
            self._frozen = FrozenWeights(self.learner)
        else:
            self._frozen.refresh(self.learner)
        return TorchBackend(self.view, self._frozen, self.generator, self._decoders)

    def sync_check(self) -> dict[str, float]:
        return {"sync/probe_gap": 0.0}

    def generation_stats(self) -> dict[str, float]:
        """The compiled decoders' costs since the last call (``CompiledDecoder.stats``), summed
        over the models sampled; nothing when decoding is not compiled."""
        out: dict[str, float] = {}
        for decoder in self._decoders.values():
            for k, v in decoder.stats().items():
                out[k] = out.get(k, 0.0) + v
        return out

    def _decoder(self) -> CompiledDecoder:
        model = self.learner.model
        if model not in self._decoders:
            self._decoders[model] = CompiledDecoder(
                model, self.cache_key, self.learner.device, static_cache
            )
        return self._decoders[model]

    @torch.no_grad()
    def generate(self, prompts, prompt_ids, settings: SamplingSettings) -> list[Sample]:
        """``settings.num_generations`` completions per prompt, ``settings.batch_size`` sequences
        per pass (None: all at once; each pass draws from the generator in turn)."""
        self.learner.model.eval()
        ids = [p for p in prompt_ids for _ in range(settings.num_generations)]
        groups = [g for g in range(len(prompts)) for _ in range(settings.num_generations)]
        step = settings.batch_size or len(ids)
        out: list[Sample] = []
        for lo in range(0, len(ids), step):
            with self.learner.logprobs.autocast():  # the policy's precision (bf16 or fp32)
                drawn = self._sample(ids[lo : lo + step], settings)
            out += self._to_samples(prompts, ids[lo : lo + step], groups[lo : lo + step], drawn)
        return out

    def _sample(self, prompt_ids, s: SamplingSettings) -> Drawn:
        """Each row's tokens (pad after its end) and behaviour log-probs (0 after its end)."""
        model, device, pad = self.learner.model, self.learner.device, self.view.pad_id
        c = collate(prompt_ids, [()] * len(prompt_ids), pad)
        P = c.input_ids.shape[1] - 1
        ids, attn = c.input_ids[:, :P].to(device), c.attention_mask[:, :P].to(device)
        pos = c.position_ids[:, :P].to(device)
        if s.generation_compile == "decode":
            return self._sample_compiled(ids, attn, pos, s)
        B, eos = ids.shape[0], self.view.tokenizer.eos_token_id
        static = s.cache_implementation == "static"
        # each distinct prompt's pass runs once, its cache and logits given to its rows
        target = static_cache(model, P + s.max_new_tokens) if static else None
        logits, cache = prefill(model, ids, attn, pos, target, self.share_prompts)
        drawn = Drawn(B, device, pad, eos, self._stop_criteria(s))
        next_pos = pos[:, -1:] + 1
        truncate = truncates(s.top_k, s.top_p)
        for i in range(s.max_new_tokens):
            if i:  # the last sampled token's forward; none after the last token is drawn
                attn = torch.cat([attn, torch.ones((B, 1), dtype=attn.dtype, device=device)], 1)
                kw = {self.cache_key: cache}
                if static:  # where this token's keys and values go in the preallocated cache
                    kw["cache_position"] = torch.full((1,), P + i - 1, device=device)
                out = model(
                    input_ids=drawn.tokens[-1].unsqueeze(-1),
                    attention_mask=attn,
                    position_ids=next_pos,
                    use_cache=True,
                    **kw,
                )
                logits, cache = out.logits[:, -1], getattr(out, self.cache_key)
                next_pos = next_pos + 1
            if drawn.keep(*draw(logits.float(), s, truncate, self.generator)):
                break
        return drawn

    def _sample_compiled(self, ids, attn, pos, s: SamplingSettings):
        """``_sample`` with the decode step compiled (compiled.py): the prompts padded to their
        bucket, an eager prefill into the bucket's static cache, then compiled one-token steps;
        the draws and log-probs are the eager sampler's, over the real rows only."""
        model, dec, pad = self.learner.model, self._decoder(), self.view.pad_id
        B, eos, device = ids.shape[0], self.view.tokenizer.eos_token_id, self.learner.device
        ids, attn, pos, mask, cache = dec.prepare(ids, attn, pos, s.max_new_tokens)
        P = ids.shape[1]
        # dummy rows copy the first prompt: they join its group, prefilled once with it
        logits = prefill(model, ids, attn, pos, cache, self.share_prompts)[0][:B].float()
        feed = torch.full((ids.shape[0], 1), pad, dtype=ids.dtype, device=device)  # dummies: pad
        next_pos, truncate = pos[:, -1:] + 1, truncates(s.top_k, s.top_p)
        drawn = Drawn(B, device, pad, eos, self._stop_criteria(s))
        for i in range(s.max_new_tokens):
            if i:
                feed[:B, 0] = drawn.tokens[-1]
                logits = dec.decode(feed, mask, next_pos, P + i - 1, cache, B)
                next_pos = next_pos + 1
            if drawn.keep(*draw(logits, s, truncate, self.generator)):
                break
        return drawn

    def _stop_criteria(self, s: SamplingSettings) -> StopStringCriteria | None:
        """transformers' stop-string matcher for ``s.stop_strings`` (None without any), built
        once per set of strings: it walks the whole vocabulary (about 1.5 s for Gemma 3's)."""
        if not s.stop_strings:
            return None
        if s.stop_strings not in self._stops:
            self._stops[s.stop_strings] = StopStringCriteria(
                self.view.tokenizer, list(s.stop_strings)
            )
        return self._stops[s.stop_strings]

    def _to_samples(self, prompts, prompt_ids, groups, drawn: Drawn) -> list[Sample]:
        tok, version = self.view.tokenizer, self.learner.version
        tokens, logps = torch.stack(drawn.tokens, 1).cpu(), torch.stack(drawn.logps, 1).cpu()
        lengths, ended = drawn.lengths.tolist(), drawn.finished.tolist()
        out = []
        for i in range(tokens.shape[0]):
            ids = tuple(tokens[i, : lengths[i]].tolist())
            out.append(
                Sample(
                    prompt=prompts[groups[i]],
                    prompt_ids=prompt_ids[i],
                    completion_ids=ids,
                    logprobs=tuple(logps[i, : lengths[i]].tolist()),
                    text=tok.decode(ids, skip_special_tokens=True),
                    finish_reason="stop" if ended[i] else "length",
                    group=groups[i],
                    policy_version=version,
                )
            )
        return out


def draw(
    logits, s: SamplingSettings, truncate: bool, generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, V) fp32 logits -> the (B,) tokens drawn from them at ``s``'s temperature and truncation
    (argmax at temperature 0) and their (B,) log-probs under the distribution drawn from."""
    if s.temperature > 0:
        if s.temperature != 1:
            logits = logits.div_(s.temperature)
        if truncate:
            logits = truncate_logits(logits, s.top_k, s.top_p)
        logp_all = torch.log_softmax(logits, -1)
        tok = sample_tokens(logp_all, generator)
    else:
        logp_all = torch.log_softmax(logits, -1)
        tok = logits.argmax(-1)
    return tok, logp_all.gather(-1, tok.unsqueeze(-1)).squeeze(-1)


class Drawn:
    """The tokens drawn so far for ``B`` rows, one (B,) tensor a step: a row ends at EOS or at the
    token that completes one of ``grpo.stop_strings`` (``stops``), which both stay in the
    completion; later steps give it pad and log-prob 0. ``lengths`` counts each row's tokens."""

    def __init__(self, B: int, device, pad: int, eos: int, stops=None) -> None:
        self.pad, self.eos, self.stops = pad, eos, stops
        self.tokens: list[torch.Tensor] = []
        self.logps: list[torch.Tensor] = []
        self.finished = torch.zeros(B, dtype=torch.bool, device=device)
        self.lengths = torch.zeros(B, dtype=torch.long, device=device)

    def keep(self, tok: torch.Tensor, lp: torch.Tensor) -> bool:
        """Append one step's draws; True once every row has ended."""
        done = self.finished
        self.tokens.append(torch.where(done, torch.full_like(tok, self.pad), tok))
        self.logps.append(torch.where(done, torch.zeros_like(lp), lp))
        self.lengths += ~done
        ended = done | (tok == self.eos)
        if self.stops is not None:  # it reads the tail only: at most a token per character
            tail = torch.stack(self.tokens[-self.stops.maximum_token_len :], 1)
            ended |= self.stops(tail, None).to(ended.device)
        self.finished = ended
        return bool(ended.all())


def static_cache(model: torch.nn.Module, length: int) -> StaticCache:
    """A KV cache for sequences of up to ``length`` tokens, allocated at its first use and then
    written in place (``grpo.cache_implementation = "static"``): the dynamic cache concatenates a
    new, one-token-longer tensor per layer at every step, which a GPU's caching allocator cannot
    reuse (guides/memory.md)."""
    return _UniformStaticCache(config=base_model(model).config, max_cache_len=length)


class _UniformStaticCache(StaticCache):
    """transformers' ``StaticCache`` with keys stored in the values' dtype, and full layers where a
    sliding-window layer would hold the whole sequence.

    A sliding-window layer (Gemma 3's five in six) counts the tokens it has seen in a Python int,
    which a compiled decode step guards on: it would compile anew at every step. When the cache is
    no longer than the window, such a layer keeps every token and masks none, as a full layer
    does, so a full one (which counts in a tensor) takes its place: the same attention, and one
    graph per bucket (``sliding`` lists the layers left as they were: the sequence outgrows their
    window).

    Under bf16 autocast over fp32 weights the keys leave the rotary embedding in fp32 (its
    cos/sin follow the fp32 hidden states) while the values leave their projection in bf16.
    Some transformers versions (5.17 among them) allocate both cache tensors in the keys' dtype
    and then fail to copy the bf16 values in; later ones keep fp32 keys, twice the memory. The
    attention casts its inputs to bf16 under autocast, so keys stored in bf16 are what it reads
    either way: the draws are those of the growing cache (tests/policies/test_static_cache.py)."""

    def __init__(self, config, max_cache_len: int) -> None:
        super().__init__(config=config, max_cache_len=max_cache_len)
        self.length = max_cache_len
        for i, layer in enumerate(self.layers):
            if isinstance(layer, StaticSlidingWindowLayer) and layer.max_cache_len >= max_cache_len:
                self.layers[i] = StaticLayer(max_cache_len=max_cache_len)
        self.sliding = [i for i, x in enumerate(self.layers) if getattr(x, "is_sliding", False)]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return super().update(
            key_states.to(value_states.dtype), value_states, layer_idx, *args, **kwargs
        )


class FrozenWeights:
    """A learner's weights and version at one moment, as much of a learner as sampling needs."""

    def __init__(self, learner) -> None:
        self.model = copy.deepcopy(learner.model).eval().requires_grad_(False)
        self.device, self.version, self.logprobs = learner.device, learner.version, learner.logprobs

    @torch.no_grad()
    def refresh(self, learner) -> None:
        self.model.load_state_dict(learner.model.state_dict())
        self.version = learner.version


GENERATION_BACKENDS.register("torch", TorchBackend)
