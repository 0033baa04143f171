"""The ``[allocation]`` table of a run config: how workers are sized, placed, run and paced.

Everything here has a default, so ``[allocation]`` may be absent. ``RunConfig.allocation`` holds
it, validated with the rest of the run config; errors name the field path
(``$.allocation.inventory``).

Memory model (bytes per parameter) — the defaults describe plain fp32 training with Adam, the
way the embedded CPU default runs:

* learner   = params x (weight_bytes + grad_bytes + optimizer_bytes) [+ params x weight_bytes for a
  frozen reference when grpo.beta > 0]; with LoRA only the frozen base weights are counted (the
  adapter and its optimizer state are small and the reference is the adapter switched off);
  plus the activations kept for backward (``allocation.specs.activation_bytes``, formula there):
  per micro-batch of ``rows`` sequences of ``seq`` = prompt_length_estimate + max_completion_length
  tokens, ``rows x seq x activation_bytes x (layers x (6 h + 2 kv + 4 i))`` without gradient
  checkpointing, ``rows x seq x activation_bytes x (layers x h + 6 h + 2 kv + 4 i)`` with it, and
  the fp32 logits and log-probs of the completion positions, ``rows x completion x vocab x 8``;
* generator = params x weight_bytes + KV cache, where the KV cache holds every sequence of a step
  at once (or ``generation_batch_tokens`` of them, or ``grpo.generation_batch_size`` sequences
  for the torch sampler): 2 (K and V) x layers x kv_heads x head_dim x weight_bytes x tokens;
  grouped-query attention (``num_key_value_heads`` < heads) shrinks it.
* a learner sharded over ``learner_ranks`` = N ranks needs, on each of N GPUs: the weights,
  gradients, optimizer state (and reference) above divided by N; the activations of its own
  micro-batch (``rows`` = the step's rows / N unless a micro-batch size is set); and its largest
  FSDP unit gathered whole for a moment (``allocation.specs.gathered_bytes``: the embedding, twice
  when untied, x (weight_bytes + grad_bytes + 4)). The generator sits on the first of its GPUs.

Architecture dims (layers ``L``, hidden ``h``, KV width ``kv`` = kv_heads x head_dim, MLP width
``i``, vocabulary) come from the checkpoint's config.json when it is on this machine, else from
``[allocation.architectures."<policy>"]``, else from the policy's own config (tiny random models).
``usable_memory_fraction`` keeps headroom for what is not modelled (temporaries of one layer's
backward, allocator fragmentation, the CUDA context). Clusters in bf16 set ``weight_bytes = 2``.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from mutualrl.config.base import ConfigStruct, check

GIB = 1024**3  # the unit of every *_gb field


class InventoryConfig(ConfigStruct, frozen=True):
    """A described cluster; when ``[allocation.inventory]`` is absent the machine is detected."""

    nodes: int = 1  # machines
    gpus_per_node: int = 0  # 0: CPU only
    gpu_memory_gb: float = 80.0  # per GPU, GiB
    cpus_per_node: int = 8  # cores the planner hands out as threads
    host_memory_gb: float = 64.0  # per node, GiB; the memory budget of CPU-only inventories

    def __post_init__(self) -> None:
        check(self.nodes >= 1, "nodes must be >= 1")
        check(self.gpus_per_node >= 0, "gpus_per_node must be >= 0")
        check(self.gpu_memory_gb > 0, "gpu_memory_gb must be > 0")
        check(self.cpus_per_node >= 1, "cpus_per_node must be >= 1")
        check(self.host_memory_gb > 0, "host_memory_gb must be > 0")


class MemoryModel(ConfigStruct, frozen=True):
    """Bytes per parameter for each kind of state (see the module docstring)."""

    weight_bytes: int = 4  # fp32; 2 for bf16 weights
    grad_bytes: int = 4  # gradients of trained parameters; fp32
    optimizer_bytes: int = 8  # Adam: two fp32 moments
    usable_memory_fraction: float = 0.9  # headroom for temporaries, allocator fragmentation
    activation_bytes: int | None = None  # per stored activation value; None: weight_bytes
    # Sequences per learner forward/backward (a micro-batch). None:
    # training.per_device_train_batch_size
    # when the run config has it, else every sequence of a step (prompts_per_step x
    # num_generations).
    micro_batch_rows: int | None = None  # sequences per learner forward/backward (see above)
    # None: training.gradient_checkpointing.
    gradient_checkpointing: bool | None = None  # whether activations are recomputed (see above)
    # A worker process that shares its GPU with other processes (executor "process" or "ray")
    # caps torch's caching allocator at its planned memory over usable_memory_fraction
    # (torch.cuda.set_per_process_memory_fraction), so its cache cannot crowd the others' out.
    cap_shared_gpus: bool = True

    def __post_init__(self) -> None:
        check(self.weight_bytes >= 1, "weight_bytes must be >= 1")
        check(
            self.activation_bytes is None or self.activation_bytes >= 1,
            "activation_bytes must be >= 1",
        )
        check(
            self.micro_batch_rows is None or self.micro_batch_rows >= 1,
            "micro_batch_rows must be >= 1",
        )
        check(self.grad_bytes >= 0, "grad_bytes must be >= 0")
        check(self.optimizer_bytes >= 0, "optimizer_bytes must be >= 0")
        check(0 < self.usable_memory_fraction <= 1, "usable_memory_fraction must be in (0, 1]")


class ArchitectureDims(ConfigStruct, frozen=True):
    """Dimensions of a checkpoint that is not on the machine that plans (its config.json names)."""

    num_hidden_layers: int  # decoder layers
    hidden_size: int  # model width
    num_attention_heads: int  # query heads
    vocab_size: int  # embedding rows (config.json's vocab_size)
    num_key_value_heads: int | None = None  # None: num_attention_heads (no grouped-query attention)
    intermediate_size: int | None = None  # None: 4 x hidden_size
    head_dim: int | None = None  # None: hidden_size / num_attention_heads
    tie_word_embeddings: bool = False  # input and output embeddings are one matrix (config.json's)

    def __post_init__(self) -> None:
        check(
            min(self.num_hidden_layers, self.hidden_size, self.num_attention_heads, self.vocab_size)
            >= 1,
            "dims must be >= 1",
        )
        check(
            self.num_key_value_heads is None or self.num_key_value_heads >= 1,
            "num_key_value_heads must be >= 1",
        )
        check(
            self.intermediate_size is None or self.intermediate_size >= 1,
            "intermediate_size must be >= 1 (or absent: 4 x hidden_size)",
        )
        check(
            self.head_dim is None or self.head_dim >= 1,
            "head_dim must be >= 1 (or absent: hidden_size / num_attention_heads)",
        )


class WorkerOverride(ConfigStruct, frozen=True):
    """Replace estimated facts of one worker (``[allocation.workers."<policy>/learner"]``)."""

    num_parameters: int | None = None  # the worker's parameter count; None: estimated
    tokens_per_step: int | None = None  # tokens it processes per step (its cost); None: estimated
    memory_gb: float | None = (
        None  # GiB it needs (each rank, for a sharded learner); None: estimated
    )

    def __post_init__(self) -> None:
        check(
            self.num_parameters is None or self.num_parameters >= 1, "num_parameters must be >= 1"
        )
        check(
            self.tokens_per_step is None or self.tokens_per_step >= 0,
            "tokens_per_step must be >= 0",
        )
        check(self.memory_gb is None or self.memory_gb >= 0, "memory_gb must be >= 0")


class AllocationConfig(ConfigStruct, frozen=True):
    """How the run's workers are planned (sizes, placement), executed and paced."""

    executor: str = (
        "local"  # local (threads here) | process (one per worker) | ray (workers.EXECUTORS)
    )
    local_mode: Literal["threads", "sequential"] = (
        "threads"  # local executor: a thread per worker, or one after another
    )
    # A failed worker: stop the run, drop the worker, or restart. `mutualrl train` restarts the
    # whole run from its last checkpoint, every worker rebuilt (run.restarts; needs save_steps).
    on_failure: Literal["stop", "continue", "restart"] = (
        "stop"  # a failed worker: stop, drop it, or restart
    )
    max_restarts: int = 1  # per worker (policy), when on_failure = "restart"
    call_timeout_s: float = 600.0  # every executor call and every paced step is bounded
    placement_timeout_s: float = 60.0  # Ray: how long all placement groups may take to be ready
    process_group_timeout_s: float = (
        120.0  # a sharded learner's ranks must form their process group within it
    )
    # The rendezvous port of the first rank group (later ones count up from it). None: each
    # group's rank 0 listens on a port the OS picks as free.
    master_port: int | None = None  # rank groups' first rendezvous port; None: free ports
    # Pacing (mutualrl.run.schedule). 0: lock-step, every policy takes each step together (one
    # group behind the gate). k >= 1: each policy runs its own step loop and may start
    # step s once every live policy has completed s - k steps; peer experience is used as it
    # arrives and dropped (counted) when older than that bound. Evaluation and checkpoints
    # are the points where all policies meet.
    max_staleness: int = 0  # steps a policy may run ahead of the slowest live one; 0: lock-step
    # Draw each policy's next samples while it updates (from the weights before the update), so
    # they are one version behind when trained on: the lag is corrected as an inexact sampler's
    # (grpo.vllm_importance_sampling_*: by default one weight per sequence against the behaviour
    # log-probs, masked outside its bounds, as TRL's; token_mask is AReaL's decoupled objective)
    # and logged (pace/*).
    async_generation: bool = False  # overlap the next step's generation with this step's update
    colocate: bool = True  # a policy's learner and generator share devices (train: must)
    prompt_length_estimate: int = 32  # tokens; prompts are not known before the run starts
    # Tokens resident in a generator's KV cache at once, as the planner estimates its memory.
    # None: every token of a step (what the HF generate backend does with one batch). A planning
    # figure only: a vLLM engine's KV cache is sized by generation.kv_cache_memory_bytes or
    # gpu_memory_utilization, not capped by this.
    generation_batch_tokens: int | None = None
    # Threads that verify a step's samples at once (each call keeps task.verifier_timeout_s);
    # they help verifiers that wait (a sandbox, a remote judge) or release the GIL. 0: one
    # sample after another, each on the verifier's own guard thread. The plan reserves cores.
    verifier_threads: int = 0  # samples verified at once; 0: one at a time
    gpu_resource: str = "GPU"  # Ray resource name for GPUs (tests use a fake one)
    ray_address: str | None = None  # None: join a running cluster or start a local one
    memory: MemoryModel = msgspec.field(default_factory=MemoryModel)  # bytes per parameter
    inventory: InventoryConfig | None = (
        None  # the cluster planned for; None: this machine, detected
    )
    # Parameter count per policy name, for checkpoints that cannot be loaded where `plan` runs.
    num_parameters: dict[str, int] = msgspec.field(default_factory=dict)  # policy -> count
    # Architecture dims per policy name, for the same checkpoints (see the module docstring).
    architectures: dict[str, ArchitectureDims] = msgspec.field(
        default_factory=dict
    )  # policy -> dims
    # Estimated facts replaced per worker name ("<policy>/learner", "<policy>/generator",
    # "verifier").
    workers: dict[str, WorkerOverride] = msgspec.field(default_factory=dict)  # worker -> override

    def __post_init__(self) -> None:
        check(self.max_restarts >= 0, "max_restarts must be >= 0")
        check(self.call_timeout_s > 0, "call_timeout_s must be > 0")
        check(self.placement_timeout_s > 0, "placement_timeout_s must be > 0")
        check(self.process_group_timeout_s > 0, "process_group_timeout_s must be > 0")
        check(
            self.master_port is None or 1024 <= self.master_port <= 65535,
            "master_port must be in [1024, 65535] (or absent: free ports)",
        )
        check(self.max_staleness >= 0, "max_staleness must be >= 0")
        check(self.prompt_length_estimate >= 1, "prompt_length_estimate must be >= 1")
        check(
            self.generation_batch_tokens is None or self.generation_batch_tokens >= 1,
            "generation_batch_tokens must be >= 1",
        )
        check(self.verifier_threads >= 0, "verifier_threads must be >= 0")
        small = [name for name, n in self.num_parameters.items() if n < 1]
        check(not small, f"num_parameters.{small[0] if small else ''} must be >= 1")
