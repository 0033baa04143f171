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
        check(self.max_grad_norm >= 0, "max_grad_norm must be >= 0")


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

    def __post_init__(self) -> None:
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

    def __post_init__(self) -> None:
        check(self.verifier_timeout_s > 0, "verifier_timeout_s must be > 0")
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
    output_dir: str = "runs/default"
    device: str = "cpu"
    torch_threads: int | None = None  # None: torch's default
    grpo: GRPOConfig = msgspec.field(default_factory=GRPOConfig)
    warmup: WarmupConfig = msgspec.field(default_factory=WarmupConfig)
    task: TaskConfig = msgspec.field(default_factory=TaskConfig)
    eval: EvalConfig = msgspec.field(default_factory=EvalConfig)
    strategies: dict[str, dict[str, Any]] = msgspec.field(default_factory=dict)
    allocation: dict[str, Any] = msgspec.field(default_factory=dict)
    exchange: ExchangeConfig = msgspec.field(default_factory=ExchangeConfig)
    report_to: list[str] = msgspec.field(default_factory=list)  # trackers: "tensorboard", "wandb"
    guards: GuardsConfig = msgspec.field(default_factory=GuardsConfig)

    def __post_init__(self) -> None:
        check(len(self.policies) >= 1, "policies must list at least one policy")
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
