"""The vLLM generation backend: one engine per policy, weights pushed after every update.

Written against vLLM's documented offline API and kept thin: ``LLM.generate`` with token-id
prompts and ``SamplingParams(n, temperature, top_p, top_k, max_tokens, logprobs=0, seed)`` (the
engine is built with ``logprobs_mode="processed_logprobs"``, so the returned log-probs are those
of the tempered, truncated distribution sampled from), ``LoRARequest`` per adapter version,
``sleep``/``wake_up``, ``reset_prefix_cache``. Full weights go in through the model's own
``load_weights`` in colocated, single-process mode (the path TRL's colocate mode takes). The
engine object is injected, so CI drives this class with a fake engine of the same interface.

Every load is verified (``sync_check``): the engine's log-probs of a fixed probe sequence must
match the trainer's within ``generation.sync_tolerance``, and an engine whose probe did not move
while the trainer's did is reported as serving stale weights.
"""

from __future__ import annotations

import copy
import os
import tempfile
from pathlib import Path

import torch

from mutualrl.grpo import selective_log_softmax
from mutualrl.policies.batch import collate
from mutualrl.policies.checkpoints import save_pretrained_quietly
from mutualrl.policies.generation import GENERATION_BACKENDS, SamplingSettings
from mutualrl.policies.samples import Sample

INSTALL = "the vllm generation backend needs vLLM on a CUDA machine: pip install 'mutualrl[vllm]'"
# A trainer probe move (max |delta log p|) above which an engine probe that stayed bitwise equal
# means the engine kept its old weights.
STALE_MOVE = 1e-3
PROBE_TEXT = "A fixed probe: the quick brown fox jumps over the lazy dog, 0 1 2 3 4 5 6 7 8 9."


class WeightSyncError(RuntimeError):
    """The engine does not serve the trainer's weights."""


class VLLMBackend:
    exact_logprobs = False

    def __init__(self, view, learner, generator: torch.Generator, llm, api,
                 work_dir: str | Path | None = None) -> None:
        """``view``: the policy's tokenizer side; ``learner``: whose weights the engine serves;
        ``llm``: a ``vllm.LLM`` (or a fake with its interface); ``api``: the module that
        provides ``SamplingParams`` and ``LoRARequest`` (``vllm`` itself, or the fake's)."""
        self.view, self.learner, self.generator = view, learner, generator
        self.llm, self.api = llm, api
        self.cfg = view.cfg.generation
        self.work_dir = Path(work_dir or tempfile.mkdtemp(prefix=f"mutualrl-{view.name}-"))
        self.lora, self.loads, self.version = None, 0, learner.version
        self.asleep = False
        self.probe_ids = view.encode_prompt(PROBE_TEXT)
        self.last_probe: tuple[torch.Tensor, torch.Tensor] | None = None   # (engine, trainer)
        self.load_weights(learner.version)

    # ---- generation -----------------------------------------------------------------------
    def generate(self, prompts, prompt_ids, settings: SamplingSettings) -> list[Sample]:
        """All prompts in one call (``settings.batch_size`` unused: vLLM schedules its own
        batches), ``n`` completions each, seeded from the policy's generator."""
        self._wake()
        seed = int(torch.randint(2**31 - 1, (1,), generator=self.generator))
        params = self.api.SamplingParams(
            n=settings.num_generations, temperature=settings.temperature, top_p=settings.top_p,
            top_k=settings.top_k if settings.top_k > 0 else -1, max_tokens=settings.max_new_tokens,
            logprobs=0, seed=seed, stop_token_ids=[self.view.tokenizer.eos_token_id])
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompt_ids], params,
                                    lora_request=self.lora, use_tqdm=False)
        samples = [self._sample(prompts[g], prompt_ids[g], g, o)
                   for g, out in enumerate(outputs) for o in out.outputs]
        self._sleep()
        return samples

    def _sample(self, prompt, prompt_ids, group, o) -> Sample:
        ids = tuple(o.token_ids)
        # logprobs=0 returns, per position, a dict holding the sampled token's Logprob
        logps = tuple(float(step[t].logprob) for t, step in zip(ids, o.logprobs))
        stopped = bool(ids) and ids[-1] == self.view.tokenizer.eos_token_id
        return Sample(prompt=prompt, prompt_ids=tuple(prompt_ids), completion_ids=ids, logprobs=logps,
                      text=self.view.tokenizer.decode(ids, skip_special_tokens=True),
                      finish_reason="stop" if stopped else "length", group=group,
                      policy_version=self.version)

    # ---- weights --------------------------------------------------------------------------
    def load_weights(self, version: int) -> None:
        """Push the policy's weights (only the adapter for a LoRA policy), then verify them."""
        self._wake()
        self.loads += 1
        if self.view.cfg.lora is not None:
            self._load_adapter()
        else:
            state = self.learner.model.state_dict()
            _engine_model(self.llm).load_weights((k, v.detach()) for k, v in state.items())
        # cached prefixes hold keys/values computed with the old weights
        self.llm.reset_prefix_cache()
        self.version = version
        if self.cfg.sync_check:
            self.sync_check()

    def _load_adapter(self) -> None:
        """A new adapter id per load: vLLM caches adapters by id, so reusing one would keep
        serving the first adapter it loaded under it. The previous adapter is removed."""
        path = self.work_dir / f"adapter-{self.loads}"
        save_pretrained_quietly(self.learner.model, path)   # a peft model saves the adapter only
        previous = self.lora
        self.lora = self.api.LoRARequest(f"{self.view.name}-{self.loads}", self.loads, str(path))
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)

    def sync_check(self) -> dict[str, float]:
        """Engine vs trainer log-probs of the probe; raise ``WeightSyncError`` when they differ."""
        engine, trainer = self._engine_probe(), self._trainer_probe()
        # The mean, not the max: a bf16 engine's kernels differ from the trainer's by a few
        # hundredths per token, with rare larger outliers even when in sync.
        diff = (engine - trainer).abs()
        gap, worst = float(diff.mean()), float(diff.max())
        name, tol = self.view.name, self.cfg.sync_tolerance
        if gap > tol:
            raise WeightSyncError(
                f"policy {name!r}: the vLLM engine's log-probs of the probe differ from the "
                f"trainer's by {gap:.4g} on average (max {worst:.4g}; tolerance "
                f"generation.sync_tolerance = {tol}) after loading version {self.version}: the "
                f"engine does not serve the trained weights")
        if self.last_probe is not None:
            moved = float((trainer - self.last_probe[1]).abs().max())
            # Below STALE_MOVE a bf16 engine may legitimately round the update away.
            if moved > STALE_MOVE and torch.equal(engine, self.last_probe[0]):
                raise WeightSyncError(
                    f"policy {name!r}: the trainer's probe log-probs moved by {moved:.4g} since "
                    f"the last load but the vLLM engine's did not change: it still serves the "
                    f"weights before version {self.version}")
        self.last_probe = (engine, trainer)
        return {"sync/probe_gap": gap, "sync/probe_gap_max": worst}

    def _engine_probe(self) -> torch.Tensor:
        """Log-probs (T-1,) the engine gives each probe token after its prefix, at temperature 1."""
        params = self.api.SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=1)
        out = self.llm.generate([{"prompt_token_ids": list(self.probe_ids)}], params,
                                lora_request=self.lora, use_tqdm=False)[0]
        # prompt_logprobs[0] is None (the first token has no prefix); every later position
        # holds the actual prompt token among its entries
        return torch.tensor([float(step[t].logprob) for t, step
                             in zip(self.probe_ids[1:], out.prompt_logprobs[1:])])

    @torch.no_grad()
    def _trainer_probe(self) -> torch.Tensor:
        learner = self.learner
        was_training = learner.model.training
        learner.model.eval()
        c = collate([self.probe_ids[:1]], [self.probe_ids[1:]], self.view.pad_id)
        logp = selective_log_softmax(learner.completion_logits(c, temperature=1.0),
                                     c.completion_ids.to(learner.device))
        learner.model.train(was_training)
        return logp[0].float().cpu()

    # ---- memory ---------------------------------------------------------------------------
    def _wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def _sleep(self) -> None:
        if self.cfg.enable_sleep_mode:
            self.llm.sleep(level=1)       # weights to CPU, KV cache freed; wake_up restores
            self.asleep = True


# Where a colocated, single-process engine keeps its model, by vLLM version (the V1 engine core
# wraps the executor one level deeper in later releases).
_MODEL_PATHS = ("llm_engine.model_executor.driver_worker.worker.model_runner.model",
                "llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.model")


def _engine_model(llm):
    """The engine's ``nn.Module``, whose ``load_weights`` takes (name, tensor) pairs named as
    in the Hugging Face checkpoint (the path TRL's and verl's colocated modes use)."""
    for path in _MODEL_PATHS:
        node = llm
        for attr in path.split("."):
            node = getattr(node, attr, None)
            if node is None:
                break
        if node is not None:
            return node
    raise RuntimeError("cannot reach the vLLM engine's model to load weights into (tried "
                       f"{', '.join(_MODEL_PATHS)}); the engine must run in this process "
                       "(VLLM_ENABLE_V1_MULTIPROCESSING=0)")


def build_vllm_backend(view, learner, generator) -> VLLMBackend:
    """A colocated engine for the policy on its device; vLLM imported only here."""
    try:
        import vllm
    except ImportError:
        raise ImportError(f"policy {view.name!r}: {INSTALL}") from None
    g, lora = view.cfg.generation, view.cfg.lora
    # the engine in this process, so its model can take weights directly (no IPC)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    work = Path(tempfile.mkdtemp(prefix=f"mutualrl-{view.name}-"))
    model_dir = view.cfg.checkpoint or _save_base(view, learner, work / "base")
    llm = vllm.LLM(model=str(model_dir), tokenizer=str(model_dir), dtype=g.dtype,
                   gpu_memory_utilization=g.gpu_memory_utilization, max_model_len=g.max_model_len,
                   enable_sleep_mode=g.enable_sleep_mode, enable_lora=lora is not None,
                   max_lora_rank=lora.r if lora else 16, logprobs_mode="processed_logprobs",
                   enable_prefix_caching=True)
    return VLLMBackend(view, learner, generator, llm, vllm, work)


def _save_base(view, learner, path: Path) -> Path:
    """A randomly initialised policy exists nowhere on disk: save its base model and tokenizer."""
    model = learner.model
    if view.cfg.lora is not None:
        # unload() takes the LoRA layers out without merging them into the base
        model = copy.deepcopy(model).unload()
    return save_pretrained_quietly(model, path, view.tokenizer)


GENERATION_BACKENDS.register("vllm", build_vllm_backend)
