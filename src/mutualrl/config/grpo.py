"""The GRPO objective and sampling (``[grpo]``) and the learners' optimizer and memory
(``[training]``), under TRL's names."""

from __future__ import annotations

from typing import Literal

from mutualrl.config.base import ConfigStruct, check


class GRPOConfig(ConfigStruct, frozen=True):
    """The GRPO objective and sampling; names as in TRL's GRPOConfig."""

    num_generations: int = 8  # completions sampled per prompt (the group size G)
    prompts_per_step: int = 8  # distinct prompts per policy per step
    max_completion_length: int = 4  # new tokens per completion; longer ones are truncated
    temperature: float = 1.0  # sampling temperature; log-probs are taken at it too
    beta: float = 0.0  # KL weight to the frozen reference (k3); 0 builds no reference
    use_bias_correction_kl: bool = (
        True  # KL term times the importance ratio (TRL's default); beta > 0 only
    )
    epsilon: float = 0.2  # lower clip of the importance ratio: 1 - epsilon
    epsilon_high: float | None = (
        None  # upper clip 1 + epsilon_high (DAPO's clip-higher); None: epsilon
    )
    # Names in grpo.NORMALISERS / grpo.REWARD_SCALINGS / grpo.ADVANTAGE_ESTIMATORS (open to
    # plug-ins; checked before a run starts): how token losses are averaged, "grpo", "dr_grpo" or
    # "dapo" (TRL's loss_type); "group", "batch" or "none" (mean-only, Dr. GRPO); "zscore" or
    # "rank" (within-group ranks first).
    loss_type: str = "grpo"  # a grpo.NORMALISERS name: "grpo", "dr_grpo", "dapo" (TRL)
    scale_rewards: str = "group"  # a grpo.REWARD_SCALINGS name: "group", "batch", "none"
    advantage_estimator: str = "zscore"  # a grpo.ADVANTAGE_ESTIMATORS name: "zscore", "rank"
    # The std of the z-score: "population" divides by n (the GRPO references; every figure in the
    # README was measured with it), "sample" by n - 1 (Bessel's correction), as TRL's GRPOTrainer.
    advantage_std: Literal["population", "sample"] = (
        "population"  # group/batch std: /n or /(n-1) (TRL)
    )
    skip_zero_std_groups: bool = False  # drop groups whose rewards are all equal (no signal)
    num_iterations: int = 1  # optimisation passes over each batch (mu in the paper)
    learning_rate: float = 1e-3  # AdamW step size (policies.<n>.learning_rate overrides)
    mask_truncated_completions: bool = False  # exclude completions cut at max_completion_length
    # Strings that end a completion as EOS does (transformers' stop_strings, vLLM's stop): the
    # token that completes one stays in the completion, which counts as ended, not truncated.
    # ["\n"] ends a base model's answer at its line instead of a new question after it.
    stop_strings: tuple[str, ...] = ()  # end a completion at one of these; []: at EOS only
    # Sampling truncation (TRL's names). Behaviour log-probs are those of the truncated,
    # renormalised distribution sampled from, and the trainer takes its log-probs under the same
    # truncation, so the on-policy ratio stays 1 (policies/sampling.py: truncate_logits).
    top_p: float = 1.0  # nucleus mass kept; 1: no nucleus truncation
    top_k: int = 0  # highest-logit tokens kept; 0: no top-k truncation
    generation_batch_size: int | None = None  # sequences per generation pass; None: all at once
    # The torch sampler's KV cache (TRL's name; the vLLM backend has its own). "dynamic" (None)
    # grows by one token a step, as TRL's default; "static" is allocated once for the longest
    # sequence: on a GPU the growing cache fragments the caching allocator (guides/memory.md).
    cache_implementation: Literal["dynamic", "static"] | None = None  # torch sampler's KV cache
    # The torch sampler's one-token decode step through torch.compile over the static cache
    # (transformers' compiled static-cache generate; CUDA graphs on a GPU), prompt and batch
    # shapes padded to powers of two so it compiles once per bucket. Needs the static cache
    # (unset cache_implementation means static then). Compile seconds are logged apart
    # (generation/compile_s) from steady-state ones (generation/decode_s). vLLM ignores it.
    generation_compile: Literal["off", "decode"] = "off"  # torch sampler: compile the decode step
    # Sampler/trainer mismatch of an inexact generation backend (vLLM), TRL's names: the trainer
    # recomputes the sampled tokens' log-probs and weights the policy term (not the KL term) by
    # pi_trainer / pi_sampler, per token or per sequence, clamped to or masked outside
    # [clip_min, clip_max]. The torch backend samples from the trainer's own distribution: no
    # correction. (vllm_importance_sampling_cap, the old name of clip_max, still reads.)
    vllm_importance_sampling_correction: bool = (
        True  # weight the policy term by pi_trainer / pi_sampler
    )
    vllm_importance_sampling_mode: Literal[
        "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"
    ] = "sequence_mask"  # per token/sequence; truncate/mask
    vllm_importance_sampling_clip_max: float | None = (
        3.0  # largest weight kept (truncate)/allowed (mask)
    )
    vllm_importance_sampling_clip_min: float | None = (
        None  # smallest weight kept/allowed; None: no bound
    )
    # sequence_* modes: exp of the mean token log-ratio (ours: length-normalised) or of the sum
    # (TRL's)
    vllm_importance_sampling_sequence_ratio: Literal["mean", "sum"] = (
        "mean"  # sequence ratio: mean or sum
    )
    # "sequence": GSPO's length-normalised sequence ratio, clipped per sequence (TRL's name)
    importance_sampling_level: Literal["token", "sequence"] = "token"  # level of the PPO ratio

    def __post_init__(self) -> None:
        check(self.num_generations >= 2, "num_generations must be >= 2 (a group needs a baseline)")
        check(self.prompts_per_step >= 1, "prompts_per_step must be >= 1")
        check(self.max_completion_length >= 1, "max_completion_length must be >= 1")
        check(self.temperature > 0, "temperature must be > 0")
        check(self.beta >= 0, "beta must be >= 0")
        check(0 < self.epsilon < 1, "epsilon must be in (0, 1)")
        check(self.epsilon_high is None or self.epsilon_high > 0, "epsilon_high must be > 0")
        check(self.num_iterations >= 1, "num_iterations must be >= 1")
        check(self.learning_rate > 0, "learning_rate must be > 0")
        check(0 < self.top_p <= 1, "top_p must be in (0, 1]")
        check(self.top_k >= 0, "top_k must be >= 0 (0: no top-k truncation)")
        check(all(self.stop_strings), "stop_strings must not hold an empty string")
        check(
            self.generation_batch_size is None or self.generation_batch_size >= 1,
            "generation_batch_size must be >= 1 (or omitted: the whole group at once)",
        )
        check(
            self.generation_compile == "off" or self.cache_implementation != "dynamic",
            'generation_compile = "decode" compiles the decode step over the static cache: '
            'set cache_implementation = "static" (or leave it unset)',
        )
        self._check_sampler_correction()

    def _check_sampler_correction(self) -> None:
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        check(high is None or high >= 1, "vllm_importance_sampling_clip_max must be >= 1 (or none)")
        check(
            low is None or 0 <= low <= 1,
            "vllm_importance_sampling_clip_min must be in [0, 1] (or none)",
        )
        check(
            low is None or high is None or low < high,
            "vllm_importance_sampling_clip_min must be below vllm_importance_sampling_clip_max",
        )
        check(
            not (
                self.vllm_importance_sampling_mode.endswith("truncate")
                and low is None
                and high is None
            ),
            "a *_truncate vllm_importance_sampling_mode needs vllm_importance_sampling_clip_max "
            "or _clip_min",
        )


class TrainingConfig(ConfigStruct, frozen=True):
    """Each learner's optimizer, schedule and memory (``[training]``, the update engine of
    ``policies/update.py``). These are the trainer's settings, under the names of transformers'
    ``TrainingArguments`` that TRL's ``GRPOConfig`` inherits; what is GRPO's own is in ``[grpo]``
    (the step size too: ``grpo.learning_rate``, overridden per policy)."""

    max_grad_norm: float = 1.0  # gradient norm clip before each optimizer step; 0: none
    # Each TrainBatch is ONE optimizer step (per iteration). It is cut into
    # max(gradient_accumulation_steps, ceil(rows / per_device_train_batch_size)) micro-batches of
    # near-equal size whose gradients accumulate with the whole batch's loss normalisation, so the
    # step equals the single pass up to float rounding. None and 1: one pass, as before.
    per_device_train_batch_size: int | None = None  # rows per forward/backward; None: all
    gradient_accumulation_steps: int = 1  # at least this many micro-batches per optimizer step
    # Positions per LM-head chunk: log-probs are computed from hidden states chunk by chunk and
    # recomputed in backward, so no (rows, T, V) logits exist. Only micro-batches with more
    # positions than this are chunked (smaller ones take the plain path); None: never.
    logprob_chunk_size: int | None = None  # positions per LM-head chunk; None: never chunk
    gradient_checkpointing: bool = (
        False  # recompute decoder activations in backward (HF, non-reentrant)
    )
    # Rows that share their prompt (a GRPO group) run its forward once and their completions
    # attend to its keys and values (policies/prefix.py): the same log-probs, loss and gradients
    # for a fraction of the positions. Applied where it is exact: one model on one device (not
    # sharded learners) without gradient checkpointing (which keeps no cache); false: every row
    # computes its whole sequence.
    shared_prefix: bool = True
    lr_scheduler_type: Literal[
        "constant",
        "constant_with_warmup",
        "linear",
        "cosine",
        "cosine_with_restarts",
        "polynomial",
        "inverse_sqrt",
    ] = "constant"  # learning-rate schedule (HF's names)
    warmup_ratio: float = 0.0  # share of the run's optimizer steps spent warming up
    weight_decay: float = 0.01  # AdamW's (torch's default 0.01)
    # The optimizer, under transformers' names (TrainingArguments.optim, which TRL's GRPOConfig
    # inherits; "adamw_torch_fused" is its default from torch 2.8): torch's AdamW, its fused kernel
    # or its loop over parameters. The same update up to float rounding; the fused kernel reads
    # each tensor once per step where the loop makes a pass per operation: Gemma 3's update 1.2x
    # faster on a CPU, SmolLM2's 1.2-1.5x (benchmarks/results/real_step.json, all against
    # all-adamw_torch).
    optim: Literal["adamw_torch_fused", "adamw_torch"] = "adamw_torch_fused"  # AdamW's kernel
    # The logged entropy: computed at this many completion tokens per micro-batch, evenly spaced
    # over them (a pass over the whole (rows, T, V) log-softmax cost 12% of a small GRPO step on
    # CPU; 128 tokens still cost 3% of a 129k-vocabulary update); None: every token. Not in the
    # loss.
    entropy_sample_size: int | None = 64  # tokens per micro-batch the logged entropy is taken at

    def __post_init__(self) -> None:
        check(
            self.per_device_train_batch_size is None or self.per_device_train_batch_size >= 1,
            "per_device_train_batch_size must be >= 1 (or absent: the whole batch at once)",
        )
        check(self.gradient_accumulation_steps >= 1, "gradient_accumulation_steps must be >= 1")
        check(
            self.logprob_chunk_size is None or self.logprob_chunk_size >= 1,
            "logprob_chunk_size must be >= 1 (or absent: no chunking)",
        )
        check(0 <= self.warmup_ratio < 1, "warmup_ratio must be in [0, 1)")
        check(
            self.entropy_sample_size is None or self.entropy_sample_size >= 1,
            "entropy_sample_size must be >= 1 (or absent: every token)",
        )
        check(
            self.warmup_ratio == 0 or self.lr_scheduler_type != "constant",
            "warmup_ratio > 0 needs a scheduler with warmup: lr_scheduler_type = "
            '"constant_with_warmup", "linear", "cosine", ... ("constant" ignores it)',
        )
        check(self.weight_decay >= 0, "weight_decay must be >= 0")
        check(self.max_grad_norm >= 0, "max_grad_norm must be >= 0")
