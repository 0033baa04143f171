"""A fake vLLM engine with the interface ``VLLMBackend`` uses, for CI (no GPU, no vLLM).

It mirrors ``vllm.LLM``: ``generate(prompts, sampling_params, lora_request=, use_tqdm=)`` with
token-id prompts, returning request outputs whose completions carry token ids, processed
log-probs (``{token_id: Logprob}`` per position) and a finish reason, and ``prompt_logprobs``;
``collective_rpc("reload_weights", kwargs={"weights_iterator": pairs, ...})`` or
``kwargs={"weights_path": folder, ...}``;
``llm_engine.remove_lora``; ``reset_prefix_cache``; ``sleep``/``wake_up``. One
``SamplingParams`` per prompt or one for all; a prompt's i-th completion is seeded seed + i, as
vLLM seeds the children of an ``n > 1`` request. LoRA adapters are
loaded from their folder the first time an id is seen and cached by id, as vLLM does.

Failures to inject: ``ignore_loads`` (the engine keeps its weights: a missed sync),
``logprob_shift`` (its log-probs differ from the trainer's by this much per token: kernel
mismatch), and it refuses to work while asleep.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch

from mutualrl.policies.sampling import sample_tokens, truncate_logits, truncates


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] | None = None  # accepted, not applied: tests/real_vllm run the real engine
    include_stop_str_in_output: bool = False


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str


API = SimpleNamespace(SamplingParams=SamplingParams, LoRARequest=LoRARequest, in_process=True)


@dataclass(frozen=True)
class Logprob:
    logprob: float


class FakeLLM:
    def __init__(self, policy, *, ignore_loads: bool = False, logprob_shift: float = 0.0) -> None:
        self.model = copy.deepcopy(policy.model).eval()
        self.eos = policy.tokenizer.eos_token_id
        self.ignore_loads, self.logprob_shift = ignore_loads, logprob_shift
        self.weight_loads = self.prefix_resets = 0
        self.asleep, self.sleeps = False, 0
        self.adapters: dict[int, dict] = {}  # lora_int_id -> adapter state, cached
        self.removed: list[int] = []
        self.llm_engine = SimpleNamespace(remove_lora=self._remove_lora)

    # ---- vLLM's LLM interface ------------------------------------------------------------
    def generate(self, prompts, sampling_params, lora_request=None, use_tqdm=True):
        assert not self.asleep, "generate called on a sleeping engine (wake_up first)"
        self._use_adapter(lora_request)
        params = (
            sampling_params
            if isinstance(sampling_params, list)
            else [sampling_params] * len(prompts)
        )
        return [
            self._request(list(item["prompt_token_ids"]), p) for item, p in zip(prompts, params)
        ]

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        """``reload_weights`` from ``weights_iterator`` (an engine in the caller's process) or
        from the safetensors files of ``weights_path`` (one in a process of its own); every
        tensor of the model must come, as a partial load would leave the rest as it was."""
        assert method == "reload_weights", method
        if "weights_path" in kwargs:
            from safetensors.torch import load_file

            pairs = {}
            for file in sorted(Path(kwargs["weights_path"]).glob("*.safetensors")):
                pairs.update(load_file(str(file)))
        else:
            pairs = dict(kwargs["weights_iterator"])
        self.weight_loads += 1
        if not self.ignore_loads:
            self.model.load_state_dict(pairs)  # strict: a name left out is an error
        return [None]

    def reset_prefix_cache(self) -> bool:
        self.prefix_resets += 1
        return True

    def sleep(self, level: int = 1) -> None:
        self.asleep, self.sleeps = True, self.sleeps + 1

    def wake_up(self) -> None:
        self.asleep = False

    def _remove_lora(self, lora_id: int) -> bool:
        self.removed.append(lora_id)
        return self.adapters.pop(lora_id, None) is not None

    # ---- the engine's work ---------------------------------------------------------------
    def _use_adapter(self, request) -> None:
        if request is None:
            return
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        if request.lora_int_id not in self.adapters:  # cached by id, as vLLM does
            state = load_file(str(Path(request.lora_path) / "adapter_model.safetensors"))
            self.adapters[request.lora_int_id] = state
        set_peft_model_state_dict(self.model, self.adapters[request.lora_int_id])

    @torch.no_grad()
    def _logp(self, ids: list[int], p: SamplingParams) -> torch.Tensor:
        """Processed log-probs (L, V) of the next token after every prefix of ``ids``."""
        logits = self.model(input_ids=torch.tensor([ids])).logits[0].float()
        if p.temperature > 0:
            logits = logits / p.temperature
            top_k = max(p.top_k, 0)
            if truncates(top_k, p.top_p):
                logits = truncate_logits(logits, top_k, p.top_p)
        return torch.log_softmax(logits, -1) + self.logprob_shift

    def _request(self, prompt: list[int], p: SamplingParams):
        prompt_logprobs = None
        if p.prompt_logprobs is not None:
            lp = self._logp(prompt, p)
            prompt_logprobs = [None] + [
                {t: Logprob(float(lp[i, t]))} for i, t in enumerate(prompt[1:])
            ]
        return SimpleNamespace(
            prompt_token_ids=prompt,
            prompt_logprobs=prompt_logprobs,
            outputs=[
                self._completion(prompt, p, torch.Generator().manual_seed((p.seed or 0) + i), i)
                for i in range(p.n)
            ],
        )

    def _completion(self, prompt, p, gen, index):
        ids, logps = [], []
        for _ in range(p.max_tokens):
            lp = self._logp(prompt + ids, p)[-1]
            tok = (
                int(lp.argmax())
                if p.temperature == 0
                else int(sample_tokens(lp[None] - self.logprob_shift, gen)[0])
            )
            ids.append(tok)
            logps.append({tok: Logprob(float(lp[tok]))})
            if tok in p.stop_token_ids:
                break
        reason = "stop" if ids and ids[-1] in p.stop_token_ids else "length"
        return SimpleNamespace(
            index=index, token_ids=ids, logprobs=logps, text="", finish_reason=reason
        )
