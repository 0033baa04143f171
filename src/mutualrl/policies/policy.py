"""A policy: model + tokenizer + optimizer (+ frozen reference), and what can be done with it.

It samples completions with behaviour log-probs, takes GRPO (+SFT) updates on ``TrainBatch``es,
evaluates pass@k, and saves/loads itself. It knows nothing of strategies or other policies.
"""

from __future__ import annotations

import contextlib
import copy
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from mutualrl.config import GRPOConfig, PolicyConfig
from mutualrl.grpo import (clipped_surrogate, completion_mask, entropy_from_logprobs,
                           selective_log_softmax, token_logprobs)
from mutualrl.policies.batch import SFTExample, TrainBatch, collate, collate_sequences
from mutualrl.policies.models import TokenizerFacts, build_model
from mutualrl.policies.sampling import sample_tokens
from mutualrl.retokenize.loaders import TokenizerHandle, load_tokenizer
from mutualrl.tasks.base import Prompt


@dataclass(frozen=True)
class Sample:
    """One completion of one prompt by one policy."""

    prompt: Prompt
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]   # includes EOS when finish_reason == "stop"
    logprobs: tuple[float, ...]       # behaviour log-probs at the sampling temperature
    text: str                         # completion text, special tokens removed
    finish_reason: str                # "stop" | "length"
    group: int                        # index of the prompt within the step
    reward: float = 0.0


class PolicyView:
    """The driver's side of a policy: its config, tokenizer and prompt encodings, and the version
    of its weights as last reported. No model: the loop holds one of these for every policy whose
    weights live in a worker process; a ``Policy`` is one too (what in-process executors run)."""

    def __init__(self, cfg: PolicyConfig, handle: TokenizerHandle) -> None:
        self.cfg = cfg
        self.name = cfg.name
        self.handle = handle
        self.tokenizer = handle.tokenizer
        self.version = 0

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id

    def encode_prompt(self, text: str) -> tuple[int, ...]:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        bos = self.tokenizer.bos_token_id
        return tuple(([bos] if bos is not None else []) + ids)

    def encode_completion(self, text: str, eos: bool = True) -> tuple[int, ...]:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return tuple(ids + ([self.tokenizer.eos_token_id] if eos else []))


def load_handles(cfgs: list[PolicyConfig]) -> dict[str, TokenizerHandle]:
    """Each distinct tokenizer of ``cfgs`` loaded once, by its spec."""
    return {spec: load_tokenizer(spec) for spec in dict.fromkeys(p.tokenizer for p in cfgs)}


# Seeded initialisation draws from torch's global RNG (forked, seeded per policy); policies built
# concurrently in threads would interleave their draws, so building is serialised.
_BUILD_LOCK = threading.Lock()


class Policy(PolicyView):
    def __init__(self, cfg: PolicyConfig, grpo: GRPOConfig, seed: int, device: str = "cpu",
                 handle: TokenizerHandle | None = None) -> None:
        super().__init__(cfg, handle or load_tokenizer(cfg.tokenizer))
        self.grpo = grpo
        self.device = torch.device(device)
        with _BUILD_LOCK:
            self.model = self._build_model(seed)
        # beta == 0 builds no reference at all; a LoRA policy's reference is its adapter disabled.
        self.reference = None
        if grpo.beta > 0 and cfg.lora is None:
            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad],
                                           lr=cfg.learning_rate or grpo.learning_rate)
        self.generator = torch.Generator().manual_seed(seed)
        self.skipped_nan_steps = 0

    def _build_model(self, seed: int) -> torch.nn.Module:
        cfg = self.cfg
        model = build_model(cfg, TokenizerFacts.of(self.tokenizer), seed).to(self.device)
        if cfg.lora is not None:
            from peft import LoraConfig, get_peft_model
            # the adapter's initialisation is seeded by the policy too, wherever it is built
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model = get_peft_model(model, LoraConfig(
                    r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                    target_modules=list(cfg.lora.target_modules), task_type="CAUSAL_LM"))
        return model

    # ---- sampling -------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: list[Prompt], num_generations: int, max_new_tokens: int,
                 temperature: float) -> list[Sample]:
        """Sample ``num_generations`` completions per prompt; temperature 0 is greedy.

        A hand-written KV-cache loop rather than ``model.generate`` so that sampling draws from
        this policy's own ``torch.Generator`` (reproducible when policies run concurrently in
        threads) and the log-probs are exactly those of the distribution sampled from.
        """
        self.model.eval()
        prompt_ids = [self.encode_prompt(p.text) for p in prompts for _ in range(num_generations)]
        groups = [g for g in range(len(prompts)) for _ in range(num_generations)]
        c = collate(prompt_ids, [()] * len(prompt_ids), self.pad_id)
        P = c.input_ids.shape[1] - 1
        ids, attn = c.input_ids[:, :P].to(self.device), c.attention_mask[:, :P].to(self.device)
        pos = c.position_ids[:, :P].to(self.device)
        B, eos = ids.shape[0], self.tokenizer.eos_token_id
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True,
                         logits_to_keep=1)
        tokens, logps = [], []
        finished = torch.zeros(B, dtype=torch.bool, device=self.device)
        next_pos = pos[:, -1:] + 1
        for _ in range(max_new_tokens):
            logits = out.logits[:, -1].float()
            if temperature > 0:
                logp_all = torch.log_softmax(logits.div_(temperature), -1)
                tok = sample_tokens(logp_all, self.generator)
            else:
                logp_all = torch.log_softmax(logits, -1)
                tok = logits.argmax(-1)
            lp = logp_all.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
            tok = torch.where(finished, torch.full_like(tok, self.pad_id), tok)
            tokens.append(tok)
            logps.append(torch.where(finished, torch.zeros_like(lp), lp))
            finished = finished | (tok == eos)
            if bool(finished.all()):
                break
            attn = torch.cat([attn, torch.ones((B, 1), dtype=attn.dtype, device=self.device)], 1)
            out = self.model(input_ids=tok.unsqueeze(-1), attention_mask=attn, position_ids=next_pos,
                             past_key_values=out.past_key_values, use_cache=True)
            next_pos = next_pos + 1
        return self._to_samples(prompts, prompt_ids, groups, torch.stack(tokens, 1).cpu(),
                                torch.stack(logps, 1).cpu())

    def _to_samples(self, prompts, prompt_ids, groups, tokens, logps) -> list[Sample]:
        eos, out = self.tokenizer.eos_token_id, []
        for i in range(tokens.shape[0]):
            row = tokens[i].tolist()
            stop = row.index(eos) + 1 if eos in row else len(row)
            ids = tuple(row[:stop])
            out.append(Sample(
                prompt=prompts[groups[i]], prompt_ids=prompt_ids[i], completion_ids=ids,
                logprobs=tuple(logps[i, :stop].tolist()),
                text=self.tokenizer.decode(ids, skip_special_tokens=True),
                finish_reason="stop" if eos in ids else "length", group=groups[i]))
        return out

    # ---- log-probs ------------------------------------------------------------------------
    def completion_logits(self, c, model=None, temperature: float | None = None) -> torch.Tensor:
        """Logits predicting each completion token: (B, T, V), computed only at those positions.

        Divided by ``temperature`` (default: the sampling temperature, so log-probs are those of
        the distribution the samples came from; SFT passes 1)."""
        model = model or self.model
        L, T = c.input_ids.shape[1], c.completion_len
        # The logits at positions L-T-1 .. L-2 predict the T completion tokens. Asking the model
        # for exactly those (not the last T+1, then slicing) spares a (B, T+1, V) copy forward
        # and a zero-filled one in backward: with a 129k vocabulary these passes cost as much
        # as the LM head itself.
        keep = torch.arange(L - T - 1, L - 1, device=self.device)
        out = model(input_ids=c.input_ids.to(self.device), attention_mask=c.attention_mask.to(self.device),
                    position_ids=c.position_ids.to(self.device), logits_to_keep=keep)
        logits = out.logits.float()
        temperature = temperature or self.grpo.temperature
        # In place: the LM head's backward needs its input and weight, not its output.
        return logits.div_(temperature) if temperature != 1 else logits

    @torch.no_grad()
    def sequence_logprobs(self, prompts: list[tuple[int, ...]], completions: list[tuple[int, ...]]) -> torch.Tensor:
        """Total log-prob of each completion under the current policy: (B,). Used for off-policy ratios."""
        self.model.eval()
        c = collate(prompts, completions, self.pad_id)
        logp = selective_log_softmax(self.completion_logits(c), c.completion_ids.to(self.device))
        return (logp.cpu() * completion_mask(c.completion_ids, c.lengths)).sum(-1)

    def _reference_logp(self, c) -> torch.Tensor | None:
        if self.grpo.beta == 0:
            return None
        with torch.no_grad():
            if self.reference is not None:
                logits = self.completion_logits(c, self.reference)
            else:
                with self.model.disable_adapter():
                    logits = self.completion_logits(c)
            return selective_log_softmax(logits, c.completion_ids.to(self.device))

    # ---- updates --------------------------------------------------------------------------
    def sft_loss(self, examples: tuple[SFTExample, ...]) -> torch.Tensor:
        """Mean token negative log-likelihood of ``examples`` (completion tokens only)."""
        c = collate([e.prompt_ids for e in examples], [e.completion_ids for e in examples], self.pad_id)
        logp, _ = token_logprobs(self.completion_logits(c, temperature=1.0), c.completion_ids.to(self.device))
        mask = completion_mask(c.completion_ids, c.lengths)
        return -(logp * mask.to(self.device)).sum() / mask.sum().clamp(min=1)

    @contextlib.contextmanager
    def _learning_rate(self, learning_rate: float | None):
        """Run the optimizer at ``learning_rate`` inside the block (None: unchanged)."""
        saved = [grp["lr"] for grp in self.optimizer.param_groups]
        if learning_rate is not None:
            for grp in self.optimizer.param_groups:
                grp["lr"] = learning_rate
        try:
            yield
        finally:
            for grp, lr in zip(self.optimizer.param_groups, saved):
                grp["lr"] = lr

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One update (``num_iterations`` optimizer steps) on a batch; NaN losses are skipped, counted."""
        with self._learning_rate(batch.learning_rate):
            return self._train_step(batch)

    def _train_step(self, batch: TrainBatch) -> dict[str, float]:
        self.model.train()
        g, stats, t0 = self.grpo, {}, time.perf_counter()
        c = collate_sequences(batch.sequences, self.pad_id) if batch.sequences else None
        if c is not None:
            mask = completion_mask(c.completion_ids, c.lengths, c.extras["truncated"],
                                   g.mask_truncated_completions).to(self.device)
            ref_logp = self._reference_logp(c)
            old = c.extras["old_logprobs"].to(self.device)
        if c is not None and batch.diagnose_sources:
            stats.update(self._source_gradients(c, mask, old, ref_logp, batch))
        for _ in range(g.num_iterations):
            loss = torch.zeros((), device=self.device)
            if c is not None:
                out, logp_all = self._grpo_loss(c, mask, old, ref_logp, c.extras["weights"], batch)
                loss = loss + out.loss
                with torch.no_grad():
                    ent = (entropy_from_logprobs(logp_all) * mask).sum() / mask.sum().clamp(min=1)
                stats.update(kl=float(out.kl), clip_ratio_low=float(out.clip_low_frac),
                             clip_ratio_high=float(out.clip_high_frac), entropy=float(ent),
                             grpo_loss=float(out.loss.detach()))
            if batch.sft and batch.sft_coef > 0:
                sft = self.sft_loss(batch.sft)
                loss = loss + batch.sft_coef * sft
                stats["sft_loss"] = float(sft.detach())
            stats.update(self._apply(loss))
        self.version += 1
        stats["step_time_s"] = time.perf_counter() - t0
        return stats

    def train_steps(self, batches: list[TrainBatch]) -> dict[str, float]:
        """Every batch of one step in order; later batches' stats are prefixed by their tag."""
        merged: dict[str, float] = {}
        for batch in batches:
            for k, v in self.train_step(batch).items():
                merged[k if batch.tag == "grpo" else f"{batch.tag}/{k}"] = v
        merged["skipped_nan_total"] = self.skipped_nan_steps
        return merged

    def update(self, batches: list[TrainBatch]) -> tuple[dict[str, float], int]:
        """``train_steps``, and the version of the weights after it (for callers in other processes)."""
        return self.train_steps(batches), self.version

    def _grpo_loss(self, c, mask, old, ref_logp, weights, batch: TrainBatch | None = None):
        g = self.grpo
        skipped = TrainBatch() if batch is None else batch  # rows left out, counted in the normaliser
        logp, logp_all = token_logprobs(self.completion_logits(c), c.completion_ids.to(self.device))
        # Rows without behaviour log-probs (peer samples) use the current policy's, detached:
        # ratio 1 on the first pass; their off-policy correction travels in ``weights``.
        old_i = torch.where(torch.isnan(old), logp.detach(), old)
        out = clipped_surrogate(
            logp, old_i, c.extras["advantages"].to(self.device), mask, epsilon=g.epsilon,
            epsilon_high=g.epsilon_high, loss_type=g.loss_type,
            max_completion_length=g.max_completion_length, ref_logp=ref_logp, beta=g.beta,
            sample_weight=weights.to(self.device), skipped_rows=skipped.skipped_rows,
            skipped_tokens=skipped.skipped_tokens)
        return out, logp_all

    def _source_gradients(self, c, mask, old, ref_logp, batch) -> dict[str, float]:
        """Gradient norms of the own and the peer samples' loss terms, and their cosine.

        Each part keeps the full batch's normaliser (rows of the other source weighted 0), so
        the two gradients sum to the gradient of the full loss.
        """
        params = [p for p in self.model.parameters() if p.requires_grad]
        is_peer = c.extras["is_peer"]
        grads = []
        for keep in (~is_peer, is_peer):
            self.optimizer.zero_grad(set_to_none=True)
            out, _ = self._grpo_loss(c, mask, old, ref_logp, c.extras["weights"] * keep.float(), batch)
            out.loss.backward()
            grads.append(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                                    for p in params]))
        self.optimizer.zero_grad(set_to_none=True)
        own, peer = grads
        cos = torch.nn.functional.cosine_similarity(own, peer, dim=0) if peer.norm() > 0 else torch.tensor(0.0)
        return {"grad/own_norm": float(own.norm()), "grad/peer_norm": float(peer.norm()),
                "grad/own_peer_cosine": float(cos)}

    def _apply(self, loss: torch.Tensor) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        if not loss.requires_grad:
            # nothing in the batch depends on the parameters (no sequences, SFT weight 0)
            return {"loss": float(loss), "skipped_empty": 1.0}
        if not torch.isfinite(loss):
            self.skipped_nan_steps += 1
            return {"loss": float("nan"), "skipped_nan": 1.0}
        loss.backward()
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, self.grpo.max_grad_norm or math.inf)
        if not torch.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped_nan_steps += 1
            return {"loss": float(loss.detach()), "skipped_nan": 1.0}
        self.optimizer.step()
        return {"loss": float(loss.detach()), "grad_norm": float(norm), "skipped_nan": 0.0}

    def sft_step(self, examples: tuple[SFTExample, ...], learning_rate: float | None = None) -> float:
        """A plain supervised step (warm start); ``learning_rate`` overrides the optimizer's for it."""
        self.model.train()
        with self._learning_rate(learning_rate):
            loss = self.sft_loss(examples)
            self._apply(loss)
        return float(loss.detach())

    # ---- persistence ----------------------------------------------------------------------
    def save_state(self, path: str | Path) -> None:
        """Everything a later run needs to continue exactly from here: weights, optimizer moments,
        the sampler's generator, the version and the skipped-step count (one torch file)."""
        torch.save({"name": self.name, "model": self.model.state_dict(),
                    "optimizer": self.optimizer.state_dict(), "generator": self.generator.get_state(),
                    "version": self.version, "skipped_nan_steps": self.skipped_nan_steps}, path)

    def load_state(self, path: str | Path) -> None:
        """Continue from a ``save_state`` file of a policy with the same config."""
        try:
            state = torch.load(path, map_location=self.device, weights_only=True)
        except Exception as exc:   # unpickling errors have no common base; name the file
            raise ValueError(f"{path}: not a policy state file ({type(exc).__name__}: {exc})") from exc
        if not isinstance(state, dict) or state.get("name") != self.name:
            held = state.get("name") if isinstance(state, dict) else None
            raise ValueError(f"{path}: holds the state of policy {held!r}, not {self.name!r}")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"].cpu())
        self.version, self.skipped_nan_steps = int(state["version"]), int(state["skipped_nan_steps"])

    def freeze_reference(self) -> None:
        """Make the KL reference the policy as it is now: RL's reference is the model RL starts
        from, i.e. after the warm start, as TRL's is the model handed to the trainer. A LoRA
        policy's reference stays its base (the adapter disabled)."""
        if self.reference is not None:
            self.reference.load_state_dict(self.model.state_dict())

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / self.name
        path.mkdir(parents=True, exist_ok=True)
        model = self.model
        if self.cfg.lora is not None and not self.cfg.checkpoint:
            # A random base exists nowhere else: saving only the adapter would lose it. Merge the
            # adapter into a copy and save a whole model.
            model = copy.deepcopy(self.model).merge_and_unload()
        model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        return path
