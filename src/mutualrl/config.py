"""One typed configuration for a run: TOML in, frozen msgspec structs out, validated once.

Field names follow TRL's ``GRPOConfig`` where the concept exists there, so TRL users feel at home.
Every error names the field path (``$.grpo.beta``) and what was expected, and is raised before any
work starts. Command-line overrides are dotted paths (``--set grpo.beta=0.01``) whose values are
parsed as TOML literals (``0.01``, ``"text"``, ``[1, 2]``, ``true``), falling back to a bare string.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

import msgspec


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the field path."""


class ConfigStruct(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of every config section: frozen, keyword-only, unknown keys rejected."""


def check(cond: bool, msg: str) -> None:
    # msgspec turns a ValueError raised in __post_init__ into a ValidationError carrying the
    # field path, which is exactly the error a user needs.
    if not cond:
        raise ValueError(msg)


class GRPOConfig(ConfigStruct):
    """The GRPO objective and sampling; names as in TRL's GRPOConfig."""

    num_generations: int = 8          # completions sampled per prompt (the group size G)
    prompts_per_step: int = 8         # distinct prompts per policy per step
    max_completion_length: int = 4    # new tokens per completion; longer ones are truncated
    temperature: float = 1.0          # sampling temperature; log-probs are taken at it too
    beta: float = 0.0                 # KL weight to the frozen reference (k3); 0 builds no reference
    epsilon: float = 0.2              # lower clip of the importance ratio: 1 - epsilon
    epsilon_high: float | None = None # upper clip 1 + epsilon_high (DAPO's clip-higher); None: epsilon
    loss_type: Literal["grpo", "dr_grpo", "dapo"] = "grpo"
    scale_rewards: Literal["group", "batch", "none"] = "group"  # "none" = mean-only (Dr. GRPO)
    advantage_estimator: Literal["zscore", "rank"] = "zscore"   # rank: within-group ranks first
    skip_zero_std_groups: bool = False  # drop groups whose rewards are all equal (no signal)
    num_iterations: int = 1           # optimisation passes over each batch (mu in the paper)
    learning_rate: float = 1e-3
    max_grad_norm: float = 1.0        # 0 disables clipping
    mask_truncated_completions: bool = False  # exclude completions cut at max_completion_length
    # Sampling truncation (TRL's names). Behaviour log-probs are those of the truncated,
    # renormalised distribution sampled from, and the trainer takes its log-probs under the same
    # truncation, so the on-policy ratio stays 1 (policies/sampling.py: truncate_logits).
    top_p: float = 1.0                # nucleus mass kept; 1: no nucleus truncation
    top_k: int = 0                    # highest-logit tokens kept; 0: no top-k truncation
    generation_batch_size: int | None = None  # sequences per generation pass; None: all at once
    # Sampler/trainer mismatch of an inexact generation backend (vLLM), TRL's names: the trainer
    # recomputes the sampled tokens' log-probs and weights the loss by pi_trainer / pi_sampler,
    # per token or per sequence (exp of the mean token log-ratio), truncated at or masked above
    # the cap. The torch backend samples from the trainer's own distribution: no correction.
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_mode: Literal["token_truncate", "token_mask", "sequence_truncate",
                                           "sequence_mask"] = "sequence_mask"
    vllm_importance_sampling_cap: float = 3.0
    # "sequence": GSPO's length-normalised sequence ratio, clipped per sequence (TRL's name)
    importance_sampling_level: Literal["token", "sequence"] = "token"
    # ---- the update engine (policies/update.py): memory, precision, schedule -----------------
    # Each TrainBatch is ONE optimizer step (per iteration). It is cut into
    # max(gradient_accumulation_steps, ceil(rows / per_device_train_batch_size)) micro-batches of
    # near-equal size whose gradients accumulate with the whole batch's loss normalisation, so the
    # step equals the single pass up to float rounding. None and 1: one pass, as before.
    per_device_train_batch_size: int | None = None  # rows per forward/backward; None: all
    gradient_accumulation_steps: int = 1  # at least this many micro-batches per optimizer step
    # Positions per LM-head chunk: log-probs are computed from hidden states chunk by chunk and
    # recomputed in backward, so no (rows, T, V) logits exist. Only micro-batches with more
    # positions than this are chunked (smaller ones take the plain path); None: never.
    logprob_chunk_size: int | None = None
    gradient_checkpointing: bool = False  # recompute decoder activations in backward (HF, non-reentrant)
    lr_scheduler_type: Literal["constant", "constant_with_warmup", "linear", "cosine",
                               "cosine_with_restarts", "polynomial", "inverse_sqrt"] = "constant"
    warmup_ratio: float = 0.0         # share of the run's optimizer steps spent warming up
    weight_decay: float = 0.01        # AdamW's (torch's default 0.01)

    def __post_init__(self) -> None:
        check(self.per_device_train_batch_size is None or self.per_device_train_batch_size >= 1,
              "per_device_train_batch_size must be >= 1 (or absent: the whole batch at once)")
        check(self.gradient_accumulation_steps >= 1, "gradient_accumulation_steps must be >= 1")
        check(self.logprob_chunk_size is None or self.logprob_chunk_size >= 1,
              "logprob_chunk_size must be >= 1 (or absent: no chunking)")
        check(self.logprob_chunk_size is None or (self.top_k == 0 and self.top_p == 1.0),
              "logprob_chunk_size takes log-probs of the untruncated distribution; with top_k or "
              "top_p truncation unset it (the chunked LM head does not truncate)")
        check(0 <= self.warmup_ratio < 1, "warmup_ratio must be in [0, 1)")
        check(self.warmup_ratio == 0 or self.lr_scheduler_type != "constant",
              "warmup_ratio > 0 needs a scheduler with warmup: lr_scheduler_type = "
              "\"constant_with_warmup\", \"linear\", \"cosine\", ... (\"constant\" ignores it)")
        check(self.weight_decay >= 0, "weight_decay must be >= 0")
        check(self.num_generations >= 2, "num_generations must be >= 2 (a group needs a baseline)")
        check(self.prompts_per_step >= 1, "prompts_per_step must be >= 1")
        check(self.max_completion_length >= 1, "max_completion_length must be >= 1")
        check(self.temperature > 0, "temperature must be > 0")
        check(self.beta >= 0, "beta must be >= 0")
        check(0 < self.epsilon < 1, "epsilon must be in (0, 1)")
        check(self.epsilon_high is None or self.epsilon_high > 0, "epsilon_high must be > 0")
        check(self.num_iterations >= 1, "num_iterations must be >= 1")
        check(self.learning_rate > 0, "learning_rate must be > 0")
        check(self.max_grad_norm >= 0, "max_grad_norm must be >= 0")
        check(0 < self.top_p <= 1, "top_p must be in (0, 1]")
        check(self.top_k >= 0, "top_k must be >= 0 (0: no top-k truncation)")
        check(self.generation_batch_size is None or self.generation_batch_size >= 1,
              "generation_batch_size must be >= 1 (or omitted: the whole group at once)")
        check(self.vllm_importance_sampling_cap >= 1, "vllm_importance_sampling_cap must be >= 1")


class WarmupConfig(ConfigStruct):
    """Supervised warm start on each policy's own prompt families, part of every run.

    It stops at ``target_accuracy`` on the policy's families (checked every ``eval_every``
    steps) so GRPO starts from a policy that solves some but not all prompts: a policy at 0%
    gets no GRPO signal, one at 100% has nothing left to learn.

    ``cache_dir``: runs whose configs agree on everything the warm start depends on share it:
    the first stores its warm-started policies there, later ones load them and skip the warm
    start (``mutualrl compare`` uses one per compare, so every strategy of a seed starts from the
    very same weights). None: every run warms up on its own.
    """

    max_steps: int = 200
    batch_size: int = 32
    learning_rate: float = 3e-3
    target_accuracy: float = 0.4
    eval_every: int = 10
    eval_prompts: int = 64
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        check(self.max_steps >= 0, "max_steps must be >= 0")
        check(self.batch_size >= 1, "batch_size must be >= 1")
        check(0 <= self.target_accuracy <= 1, "target_accuracy must be in [0, 1]")
        check(self.eval_every >= 1, "eval_every must be >= 1")
        check(self.eval_prompts >= 1, "eval_prompts must be >= 1")
        check(self.learning_rate > 0, "learning_rate must be > 0")


class LoraConfig(ConfigStruct):
    r: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: list[str] = msgspec.field(default_factory=lambda: ["q_proj", "v_proj"])


class GenerationConfig(ConfigStruct):
    """How one policy samples: the backend (policies.generation.GENERATION_BACKENDS) and the
    vLLM engine's settings (ignored by the torch backend)."""

    backend: Literal["torch", "vllm"] = "torch"
    gpu_memory_utilization: float = 0.3   # vLLM: share of its GPU the engine reserves (the plan counts it)
    enable_sleep_mode: bool = False       # vLLM: release the engine's memory between generations
    dtype: str = "auto"                   # vLLM model dtype ("auto", "bfloat16", "float16", ...)
    max_model_len: int | None = None      # vLLM: context length; None: the model's
    sync_check: bool = True               # probe the engine after every weight load
    sync_tolerance: float = 0.1           # largest mean |engine - trainer| probe log-prob gap accepted

    def __post_init__(self) -> None:
        check(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization must be in (0, 1]")
        check(self.sync_tolerance > 0, "sync_tolerance must be > 0")
        check(self.max_model_len is None or self.max_model_len >= 1, "max_model_len must be >= 1")


class PolicyConfig(ConfigStruct):
    """One policy: a model of some architecture on some tokenizer, trained by its own optimizer."""

    name: str
    architecture: str = "llama"       # a registered architecture (policies.models.ARCHITECTURES)
    tokenizer: str = "mistral-v1"     # packaged tokenizer name or path (retokenize.loaders)
    checkpoint: str | None = None     # local path of a pretrained model; None: random init
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int | None = None  # None: 4 * hidden_size
    learning_rate: float | None = None    # None: grpo.learning_rate
    warmup_families: list[str] = msgspec.field(default_factory=list)  # warm start on these
    lora: LoraConfig | None = None
    # Prompt rendering (policies.prompting): false renders the raw question; true renders it
    # with the tokenizer's own chat template; a path names a Jinja template file to use instead.
    chat_template: bool | str = False
    system_prompt: str | None = None  # with a chat template: a system message first
    generation: GenerationConfig = msgspec.field(default_factory=GenerationConfig)
    # Compute precision. "bf16": forward and backward under bf16 autocast, fp32 master weights and
    # AdamW moments (bf16 weights would round away small AdamW updates); log-softmax stays fp32.
    dtype: Literal["fp32", "bf16"] = "fp32"

    def __post_init__(self) -> None:
        check(self.system_prompt is None or self.chat_template is not False,
              "system_prompt needs chat_template = true (or a template file)")
        check(bool(self.name) and "/" not in self.name, "name must be non-empty without '/'")
        check(self.hidden_size % self.num_heads == 0, "hidden_size must be divisible by num_heads")
        check(self.num_layers >= 1, "num_layers must be >= 1")


class TaskConfig(ConfigStruct):
    name: str = "pointer"             # a registered task (tasks.TASKS)
    path: str | None = None           # data file for file-based tasks (e.g. jsonl)
    families: list[str] = msgspec.field(default_factory=list)  # empty: all the task has
    num_words: int = 4                # pointer and lookup tasks: words per prompt
    num_keys: int = 8                 # lookup task: facts per family
    verifier_timeout_s: float = 5.0
    # Dataset tasks (gsm8k, math; see tasks.datasets): columns of the data (None: the task's
    # default), the `datasets` split and configuration read, and the held-out rule for rows
    # without a split column: every `heldout_every`-th row (1-based) is held out.
    question_column: str | None = None
    answer_column: str | None = None
    split_column: str | None = None
    family_column: str | None = None
    dataset_split: str = "train"
    dataset_config: str | None = None
    heldout_every: int = 8
    # Reward functions (tasks.rewards.REWARD_FUNCS) and their weights, TRL's names; empty: the
    # task's verifier alone, weight 1.
    reward_funcs: list[str] = msgspec.field(default_factory=list)
    reward_weights: list[float] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        check(self.verifier_timeout_s > 0, "verifier_timeout_s must be > 0")
        check(self.heldout_every >= 2, "heldout_every must be >= 2")
        check(not self.reward_weights or len(self.reward_weights) == len(self.reward_funcs),
              f"reward_weights must have one weight per reward_funcs entry "
              f"({len(self.reward_funcs)}), got {len(self.reward_weights)}")
        check(self.num_words >= 2, "num_words must be >= 2")
        check(self.num_keys >= 1, "num_keys must be >= 1")


class EvalConfig(ConfigStruct):
    every: int = 10                   # held-out evaluation every N steps (0: only at the end)
    num_prompts: int = 64             # per family
    k: int = 4                        # pass@k samples per prompt

    def __post_init__(self) -> None:
        check(self.every >= 0, "every must be >= 0 (0: only at the start and the end)")
        check(self.num_prompts >= 1, "num_prompts must be >= 1")
        check(self.k >= 1, "k must be >= 1")


class ExchangeConfig(ConfigStruct):
    """How experience moves: the bus, the run's experience log, recorded peers."""

    log: bool = True                  # write RUN_DIR/experience/ (replayable, `mutualrl exchange inspect`)
    queue_size: int = 65536           # per subscriber; overflow is counted, never silent
    overflow: Literal["block", "drop_oldest"] = "drop_oldest"
    block_timeout_s: float = 30.0
    success_threshold: float = 1.0    # rewards >= this are also published as VerifiedSuccess
    # Experience logs of earlier runs replayed as frozen peers ("teacher pool"): their rollouts
    # for the current prompts join the peer experience with their recorded rewards.
    peer_logs: list[str] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        check(self.queue_size >= 1, "queue_size must be >= 1")
        check(self.block_timeout_s > 0, "block_timeout_s must be > 0")


class DiversityConfig(ConfigStruct):
    """Optional diversity regulariser on top of any strategy (``mutualrl.strategies.diversity``).

    ``coef`` > 0 makes a policy's success worth less where its peers succeed on the same prompt:
    the reward its GRPO advantages see is ``r - coef * r * s_peers(prompt)``. 0: off.
    """

    coef: float = 0.0

    def __post_init__(self) -> None:
        check(0 <= self.coef <= 1, "coef must be in [0, 1] (0 turns the regulariser off)")


class GuardsConfig(ConfigStruct):
    """Stop the run cleanly when a policy goes wrong (mutualrl.guards); every guard off by default."""

    max_kl: float | None = None                   # stop when a policy's kl to its reference exceeds it
    reward_collapse_fraction: float | None = None # stop when the last-window mean reward < this x best
    reward_window: int = 5                        # steps per reward window
    max_nan_steps: int | None = None              # stop after this many consecutive NaN-loss steps

    def __post_init__(self) -> None:
        check(self.max_kl is None or self.max_kl > 0, "max_kl must be > 0")
        check(self.reward_collapse_fraction is None or 0 < self.reward_collapse_fraction <= 1,
              "reward_collapse_fraction must be in (0, 1]")
        check(self.reward_window >= 1, "reward_window must be >= 1")
        check(self.max_nan_steps is None or self.max_nan_steps >= 1, "max_nan_steps must be >= 1")


class RunConfig(ConfigStruct):
    """The whole run. ``strategies`` holds per-strategy parameter tables, checked by each strategy."""

    policies: list[PolicyConfig]
    seed: int = 0
    steps: int = 40
    strategy: str = "none"
    # Where the policies start (mutualrl.scenarios): disjoint | overlap | asymmetric; parameters
    # in [scenarios.<name>].
    scenario: str = "disjoint"
    output_dir: str = "runs/default"
    device: str = "cpu"
    torch_threads: int | None = None  # None: torch's default
    grpo: GRPOConfig = msgspec.field(default_factory=GRPOConfig)
    warmup: WarmupConfig = msgspec.field(default_factory=WarmupConfig)
    task: TaskConfig = msgspec.field(default_factory=TaskConfig)
    eval: EvalConfig = msgspec.field(default_factory=EvalConfig)
    strategies: dict[str, dict[str, Any]] = msgspec.field(default_factory=dict)
    scenarios: dict[str, dict[str, Any]] = msgspec.field(default_factory=dict)
    allocation: dict[str, Any] = msgspec.field(default_factory=dict)
    exchange: ExchangeConfig = msgspec.field(default_factory=ExchangeConfig)
    diversity: DiversityConfig = msgspec.field(default_factory=DiversityConfig)
    # Checkpoints (TRL's names): every save_steps GRPO steps under RUN_DIR/checkpoints/, keeping
    # the newest save_total_limit (None: all). 0: none, and `mutualrl train --resume` has nothing
    # to resume from. See mutualrl.checkpoint.
    save_steps: int = 0
    save_total_limit: int | None = None
    report_to: list[str] = msgspec.field(default_factory=list)  # trackers: "tensorboard", "wandb"
    guards: GuardsConfig = msgspec.field(default_factory=GuardsConfig)

    def __post_init__(self) -> None:
        check(len(self.policies) >= 1, "policies must list at least one policy")
        check(self.save_steps >= 0, "save_steps must be >= 0 (0: no checkpoints)")
        check(self.save_total_limit is None or self.save_total_limit >= 1,
              "save_total_limit must be >= 1 (or absent: keep every checkpoint)")
        names = [p.name for p in self.policies]
        check(len(set(names)) == len(names), f"policy names must be unique, got {names}")
        check(self.steps >= 0, "steps must be >= 0")


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_override(data: dict[str, Any], dotted: str) -> None:
    """Apply ``a.b.c=value`` to a nested dict; list elements by index (``policies.0.name=x``)."""
    if "=" not in dotted:
        raise ConfigError(f"override {dotted!r}: expected KEY=VALUE, e.g. grpo.beta=0.01")
    key, _, raw = dotted.partition("=")
    parts = key.strip().split(".")
    node: Any = data
    for i, part in enumerate(parts[:-1]):
        where = ".".join(parts[: i + 1])
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"override {key}: {where} needs an index below {len(node)}")
            node = node[int(part)]
        else:
            node = node.setdefault(part, {})
        if not isinstance(node, (dict, list)):
            raise ConfigError(f"override {key}: {where} is a value, not a table")
    last = parts[-1]
    if isinstance(node, list):
        if not last.isdigit() or int(last) >= len(node):
            raise ConfigError(f"override {key}: needs an index below {len(node)}")
        node[int(last)] = _parse_value(raw.strip())
    else:
        node[last] = _parse_value(raw.strip())


def config_from_dict(data: dict[str, Any], source: str = "<config>") -> RunConfig:
    try:
        cfg = msgspec.convert(data, RunConfig, strict=True)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    # The allocation section is typed by its own layer; imported here, not at module level,
    # because that layer imports this module.
    from mutualrl.allocation.config import parse_allocation
    try:
        parse_allocation(cfg.allocation)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    from mutualrl.scenarios import check_scenario
    try:
        check_scenario(cfg)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    return cfg


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read a TOML file, apply dotted overrides, and validate everything once."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except (FileNotFoundError, IsADirectoryError):
        raise ConfigError(f"config file not found: {path} (expected a TOML file)") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    for item in overrides:
        apply_override(data, item)
    return config_from_dict(data, str(path))


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    return msgspec.to_builtins(cfg)
