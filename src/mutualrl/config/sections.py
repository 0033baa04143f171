"""The run config's smaller sections: warm start, policies (with LoRA and generation), task,
evaluation, exchange, diversity regulariser and guards."""

from __future__ import annotations

import re
from typing import Literal

import msgspec

from mutualrl.config.base import ConfigStruct, check


class WarmupConfig(ConfigStruct, frozen=True):
    """Supervised warm start on each policy's own prompt families, part of every run.

    It stops at ``target_accuracy`` on the policy's families (checked every ``eval_every``
    steps) so GRPO starts from a policy that solves some but not all prompts: a policy at 0%
    gets no GRPO signal, one at 100% has nothing left to learn.

    ``cache_dir``: runs whose configs agree on everything the warm start depends on share it:
    the first stores its warm-started policies there, later ones load them and skip the warm
    start (``mutualrl compare`` uses one per compare, so every strategy of a seed starts from the
    very same weights). None: every run warms up on its own.
    """

    max_steps: int = 200  # most warm-start steps; 0: no warm start
    batch_size: int = 32  # demonstrations per warm-start step
    learning_rate: float = 3e-3  # the warm start's own AdamW step size
    target_accuracy: float = 0.4  # stop once the probe accuracy on its own families reaches it
    eval_every: int = 10  # probe accuracy every N warm-start steps
    eval_prompts: int = 64  # prompts per accuracy probe
    cache_dir: str | None = None  # share warm starts between runs (see above); None: no cache

    def __post_init__(self) -> None:
        check(self.max_steps >= 0, "max_steps must be >= 0")
        check(self.batch_size >= 1, "batch_size must be >= 1")
        check(0 <= self.target_accuracy <= 1, "target_accuracy must be in [0, 1]")
        check(self.eval_every >= 1, "eval_every must be >= 1")
        check(self.eval_prompts >= 1, "eval_prompts must be >= 1")
        check(self.learning_rate > 0, "learning_rate must be > 0")


class LoraConfig(ConfigStruct, frozen=True):
    """A LoRA adapter on a policy (``[policies.lora]``, PEFT's settings): only it is trained."""

    r: int = 8  # adapter rank
    alpha: int = 16  # scaling numerator: the update is scaled by alpha / r
    dropout: float = 0.0  # dropout on the adapter's input
    target_modules: list[str] = msgspec.field(
        default_factory=lambda: ["q_proj", "v_proj"]
    )  # adapted

    def __post_init__(self) -> None:
        check(self.r >= 1, "r must be >= 1")
        # alpha = 0 scales every update to nothing: an adapter that never changes the policy
        check(self.alpha >= 1, "alpha must be >= 1 (the update is scaled by alpha / r)")
        check(0 <= self.dropout < 1, "dropout must be in [0, 1)")


class GenerationConfig(ConfigStruct, frozen=True):
    """How one policy samples: the backend (policies.generation.GENERATION_BACKENDS) and the
    vLLM engine's settings (ignored by the torch backend)."""

    backend: Literal["torch", "vllm"] = "torch"  # who samples: HF generate or a vLLM engine
    gpu_memory_utilization: float = (
        0.3  # vLLM: share of its GPU the engine reserves (the plan counts it)
    )
    # vLLM: bytes for the KV cache, instead of gpu_memory_utilization; required on vLLM's CPU build
    kv_cache_memory_bytes: int | None = None
    enforce_eager: bool = False  # vLLM: no CUDA graphs / compilation (starts in seconds)
    enable_sleep_mode: bool = False  # vLLM: release the engine's memory between generations
    dtype: str = "auto"  # vLLM model dtype; "auto": the policy's dtype ("float32", "bfloat16", ...)
    max_model_len: int | None = None  # vLLM: context length; None: the model's
    sync_check: bool = True  # probe the engine after every weight load
    # largest probe log-prob gap accepted (vLLM: mean |engine - trainer|; a sharded learner's
    # copy: max); None: 0.01 when the probe runs in float32, 0.1 in bf16/fp16
    # (generation.sync_tolerance)
    sync_tolerance: float | None = None

    def __post_init__(self) -> None:
        check(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization must be in (0, 1]")
        check(
            self.sync_tolerance is None or self.sync_tolerance > 0,
            "sync_tolerance must be > 0 (or none: by precision)",
        )
        check(self.max_model_len is None or self.max_model_len >= 1, "max_model_len must be >= 1")
        check(
            self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes >= 1,
            "kv_cache_memory_bytes must be >= 1",
        )


class ShardingConfig(ConfigStruct, frozen=True):
    """How a policy's learner runs across ``learner_ranks`` processes (``[policies.sharding]``,
    FSDP2; ignored at one rank). Mixed precision follows the policy's ``dtype``: "bf16" computes in
    bf16 with fp32 parameters and fp32 gradient reduction (FSDP2's ``MixedPrecisionPolicy``)."""

    cpu_offload: bool = (
        False  # keep sharded parameters, gradients and AdamW state in host RAM (GPU only)
    )
    reshard_after_forward: bool = (
        True  # free gathered layers after forward (less memory, one more all-gather)
    )


# A policy's name becomes folder and file names (RUN_DIR/policies/<name>, checkpoints, warm-start
# files) and metric keys: a safe set only, never "." or ".." (RUN_DIR/policies/.. is RUN_DIR).
POLICY_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
POLICY_NAME_RULE = (
    "1 to 64 letters, digits, '-', '_' or '.' (not '.' or '..' alone); it names "
    "the policy's folders and files"
)


def safe_policy_name(name: str) -> bool:
    return POLICY_NAME.fullmatch(name) is not None and name not in (".", "..")


class PolicyConfig(ConfigStruct, frozen=True):
    """One policy: a model of some architecture on some tokenizer, trained by its own optimizer."""

    name: str  # unique; 1-64 letters, digits, - _ . (not . or ..); names workers, metrics, folders
    # Random-init model: a registered architecture (policies.models.ARCHITECTURES): llama, qwen2,
    # mistral, gemma3 (Gemma 3's sliding-window layers, five in six)
    architecture: str = "llama"  # random-init model: a registered architecture (see above)
    # Packaged tokenizer name or path (retokenize.loaders). None: the checkpoint's own tokenizer
    # (the checkpoint folder, or the packaged model's), else "mistral-v1" for a random model.
    tokenizer: str | None = None  # tokenizer spec (see above); set after parsing, never None
    # Local folder, hub name in the local cache, or packaged model name (policies.packaged:
    # "smollm2-135m-instruct", "gemma-3-270m"); None: random init of `architecture`.
    checkpoint: str | None = None  # pretrained model (see above); None: random init
    hidden_size: int = 64  # random-init model: width
    num_layers: int = 2  # random-init model: decoder layers
    num_heads: int = 4  # random-init model: attention heads (also key/value heads)
    intermediate_size: int | None = None  # None: 4 * hidden_size
    learning_rate: float | None = None  # None: grpo.learning_rate
    warmup_families: list[str] = msgspec.field(default_factory=list)  # warm start on these
    lora: LoraConfig | None = None  # train a LoRA adapter only; None: every weight
    # Prompt rendering (policies.prompting): false renders the raw question; true renders it
    # with the tokenizer's own chat template; a path names a Jinja template file to use instead.
    chat_template: bool | str = False  # how prompts are rendered (see above)
    system_prompt: str | None = None  # with a chat template: a system message first
    # Text put before every question this policy reads, inside its own rendering (raw text, or
    # the user's turn under a chat template): worked examples in the task's pattern for a base
    # model (few-shot prompting), which it otherwise continues in its own way. Only this
    # policy's prompt changes: the prompt's id, the verifier and what peers receive are the
    # task's question alone, and under training.shared_prefix each group computes it once.
    prompt_prefix: str = ""  # text before every question (few-shot examples); "": none
    generation: GenerationConfig = msgspec.field(
        default_factory=GenerationConfig
    )  # sampling backend
    # Compute precision. "bf16": forward and backward under bf16 autocast, fp32 master weights and
    # AdamW moments (bf16 weights would round away small AdamW updates); log-softmax stays fp32.
    # "auto": bf16 where the device multiplies bf16 natively (CUDA; a CPU with AVX512-BF16 or
    # AMX) and the model is at least 256 wide, fp32 elsewhere; the run folder's config.json and
    # plan say which (policies.precision). A CPU without bf16 matrix instructions emulates bf16,
    # 10-25x slower than fp32: "auto" never chooses it there, and "bf16" warns before the run.
    dtype: Literal["auto", "fp32", "bf16"] = "auto"  # compute precision (see above)
    # transformers' attention kernel for the learner and the torch sampler (its name, as TRL's
    # model_init_kwargs pass it): "sdpa", "eager", "flash_attention_2", ...; None: transformers'
    # choice (sdpa).
    attn_implementation: str | None = None  # attention kernel (transformers' name); None: its own
    # The attention kernel of the training steps alone (GRPO updates and SFT steps: their forward
    # and backward), when it should differ from the sampler's; None: attn_implementation. On a
    # CPU, sdpa's flash-attention backward is a large share of a small model's update while sdpa
    # decodes faster than eager: SmolLM2's update took 1.7x less time under "eager", its
    # generation 1.3-1.5x more (benchmarks/results/real_step.json, the runs labelled attention).
    # The sampler's log-probs then come from the other kernel (equal in fp32, within bf16's
    # rounding in bf16).
    train_attn_implementation: str | None = None  # the update's attention; None: as the sampler's
    # Processes the learner runs as, one device each, its model sharded across them with FSDP2
    # (docs/guides/policies-across-gpus.md). 1: one process, unsharded, exactly as before.
    learner_ranks: int = 1  # learner processes (FSDP2 ranks); 1: unsharded
    sharding: ShardingConfig = msgspec.field(
        default_factory=ShardingConfig
    )  # learner_ranks > 1 only

    def __post_init__(self) -> None:
        if self.tokenizer is None:  # a pretrained model brings its own tokenizer
            msgspec.structs.force_setattr(self, "tokenizer", self.checkpoint or "mistral-v1")
        check(
            self.system_prompt is None or self.chat_template is not False,
            "system_prompt needs chat_template = true (or a template file)",
        )
        check(safe_policy_name(self.name), f"name {self.name!r}: expected {POLICY_NAME_RULE}")
        check(self.hidden_size >= 1, "hidden_size must be >= 1")
        check(self.num_heads >= 1, "num_heads must be >= 1")
        check(self.hidden_size % self.num_heads == 0, "hidden_size must be divisible by num_heads")
        check(self.num_layers >= 1, "num_layers must be >= 1")
        check(
            self.intermediate_size is None or self.intermediate_size >= 1,
            "intermediate_size must be >= 1 (or absent: 4 x hidden_size)",
        )
        check(
            self.learning_rate is None or self.learning_rate > 0,
            "learning_rate must be > 0 (or absent: grpo.learning_rate)",
        )
        check(self.learner_ranks >= 1, "learner_ranks must be >= 1")
        check(
            self.learner_ranks == 1 or self.lora is None,
            "learner_ranks > 1 shards a full fine-tune; a LoRA policy runs on one rank "
            "(its trained state is small): set learner_ranks = 1 or remove [policies.lora]",
        )


class TaskConfig(ConfigStruct, frozen=True):
    """The task every policy is trained and evaluated on, and its rewards."""

    name: str = "pointer"  # a registered task (tasks.TASKS)
    path: str | None = None  # data file for file-based tasks (e.g. jsonl)
    families: list[str] = msgspec.field(default_factory=list)  # empty: all the task has
    num_words: int = 4  # pointer and lookup tasks: words per prompt
    num_keys: int = 8  # lookup task: facts per family
    verifier_timeout_s: float = 5.0  # a verifier call running longer scores 0 (counted)
    # Dataset tasks (gsm8k, math; see tasks.datasets): columns of the data (None: the task's
    # default), the `datasets` split and configuration read, and the held-out rule for rows
    # without a split column: every `heldout_every`-th row (1-based) is held out.
    question_column: str | None = None  # dataset tasks: column of the question
    answer_column: str | None = None  # dataset tasks: column of the reference answer
    split_column: str | None = None  # dataset tasks: column saying train or held-out
    family_column: str | None = None  # dataset tasks: column naming the prompt's family
    dataset_split: str = "train"  # dataset tasks: the `datasets` split read
    dataset_config: str | None = None  # dataset tasks: the `datasets` configuration read
    heldout_every: int = 8  # dataset tasks without a split column: every N-th row held out
    # Arithmetic task (tasks.arithmetic): each family's operand digits (count: the digit string's
    # length; a family not named keeps its default), the prompt's wording, and the held-out set:
    # `heldout_size` distinct problems per family drawn with `heldout_seed`, whatever the run seed.
    digits: dict[str, int] = msgspec.field(default_factory=dict)  # arithmetic: family -> digits
    prompt_style: str = "both"  # arithmetic: "both", "instruction" or "completion" (PROMPT_STYLES)
    heldout_size: int = 64  # arithmetic: distinct held-out problems per family
    heldout_seed: int = 0  # arithmetic: seeds the held-out problems (not the run seed)
    # Reward functions (tasks.rewards.REWARD_FUNCS) and their weights, TRL's names; empty: the
    # task's verifier alone, weight 1.
    reward_funcs: list[str] = msgspec.field(default_factory=list)  # summed reward functions
    reward_weights: list[float] = msgspec.field(
        default_factory=list
    )  # one per function; empty: 1 each

    def __post_init__(self) -> None:
        check(self.verifier_timeout_s > 0, "verifier_timeout_s must be > 0")
        check(self.heldout_every >= 2, "heldout_every must be >= 2")
        check(
            not self.reward_weights or len(self.reward_weights) == len(self.reward_funcs),
            f"reward_weights must have one weight per reward_funcs entry "
            f"({len(self.reward_funcs)}), got {len(self.reward_weights)}",
        )
        check(self.num_words >= 2, "num_words must be >= 2")
        check(self.num_keys >= 1, "num_keys must be >= 1")
        check(self.heldout_size >= 1, "heldout_size must be >= 1")
        check(
            0 <= self.heldout_seed < 2**32, "heldout_seed must be in [0, 2**32 - 1] (numpy's seeds)"
        )
        # each family's range is the task's (tasks.arithmetic); no family has fewer than 1 digit
        few = [family for family, d in self.digits.items() if d < 1]
        check(not few, f"digits.{few[0] if few else ''} must be >= 1")


class EvalConfig(ConfigStruct, frozen=True):
    """Held-out evaluation: pass@k on every family, at the start, every N steps and at the end."""

    every: int = 10  # held-out evaluation every N steps (0: only at the end)
    num_prompts: int = 64  # distinct problems per family (fewer where a family has fewer)
    k: int = 4  # pass@k samples per prompt
    # The split evaluated: "heldout", the test; "validation" (disjoint from it and from
    # training) to choose settings on, so the test never chooses anything. heldout.jsonl's
    # records name it.
    split: Literal["heldout", "validation"] = "heldout"  # the split evaluated (see above)

    def __post_init__(self) -> None:
        check(self.every >= 0, "every must be >= 0 (0: only at the start and the end)")
        check(self.num_prompts >= 1, "num_prompts must be >= 1")
        check(self.k >= 1, "k must be >= 1")


class ExchangeConfig(ConfigStruct, frozen=True):
    """How experience moves: the bus, the run's experience log, recorded peers."""

    log: bool = True  # write RUN_DIR/experience/ (replayable, `mutualrl exchange inspect`)
    queue_size: int = 65536  # per subscriber; overflow is counted, never silent
    overflow: Literal["block", "drop_oldest"] = "drop_oldest"  # what a full subscriber queue does
    block_timeout_s: float = 30.0  # "block": longest wait for room before failing
    success_threshold: float = 1.0  # rewards >= this are also published as VerifiedSuccess
    # Experience logs of earlier runs replayed as frozen peers ("teacher pool"): their rollouts
    # for the current prompts join the peer experience with their recorded rewards.
    peer_logs: list[str] = msgspec.field(default_factory=list)  # run folders replayed as peers

    def __post_init__(self) -> None:
        check(self.queue_size >= 1, "queue_size must be >= 1")
        check(self.block_timeout_s > 0, "block_timeout_s must be > 0")


class DiversityConfig(ConfigStruct, frozen=True):
    """Optional diversity regulariser on top of any strategy (``mutualrl.strategies.diversity``).

    ``coef`` > 0 makes a policy's success worth less where its peers succeed on the same prompt:
    the reward its GRPO advantages see is ``r - coef * r * s_peers(prompt)``. 0: off.
    """

    coef: float = 0.0  # weight of the peers' success on a prompt; 0: off

    def __post_init__(self) -> None:
        check(0 <= self.coef <= 1, "coef must be in [0, 1] (0 turns the regulariser off)")


class GuardsConfig(ConfigStruct, frozen=True):
    """Stop the run cleanly when a policy goes wrong (mutualrl.guards); every guard off by
    default."""

    max_kl: float | None = None  # stop when a policy's kl to its reference exceeds it
    reward_collapse_fraction: float | None = (
        None  # stop when the last-window mean reward < this x best
    )
    reward_window: int = 5  # steps per reward window
    max_nan_steps: int | None = None  # stop after this many consecutive NaN-loss steps

    def __post_init__(self) -> None:
        check(self.max_kl is None or self.max_kl > 0, "max_kl must be > 0")
        check(
            self.reward_collapse_fraction is None or 0 < self.reward_collapse_fraction <= 1,
            "reward_collapse_fraction must be in (0, 1]",
        )
        check(self.reward_window >= 1, "reward_window must be >= 1")
        check(self.max_nan_steps is None or self.max_nan_steps >= 1, "max_nan_steps must be >= 1")
