"""What the planner plans for: worker specs (who needs what) and an inventory (what there is).

The cost and memory estimates are pure functions; ``worker_specs_from_config`` and
``detect_inventory`` are the only places that look at a run config or at the machine.

Cost model: a forward pass costs about 2·N FLOPs per token and forward+backward about 6·N (the
usual dense-transformer estimate, attention ignored), so generation costs 2·N·tokens and learning
6·N·tokens per pass over the step's tokens (x num_iterations). The verifier is not modelled as
compute (the built-in verifiers are string checks).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Literal

import msgspec

from mutualrl.allocation.dims import Dims, resolve_dims, tied_embeddings
from mutualrl.config import (
    GIB,
    AllocationConfig,
    ConfigError,
    InventoryConfig,
    MemoryModel,
    RunConfig,
)

Role = Literal["learner", "generator", "verifier"]

# FLOPs per parameter per token, by role (see the module docstring).
FLOPS_PER_PARAM_TOKEN: dict[str, int] = {"generator": 2, "learner": 6, "verifier": 0}


class WorkerSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One worker to place. ``group``: workers with the same group share devices (colocation)."""

    name: str  # "<policy>/<role>", or "verifier"
    role: Role
    policy: str | None
    num_parameters: int
    tokens_per_step: int
    memory_bytes: int  # on its devices (GPU) or in host RAM (CPU-only); per rank with ranks
    group: str  # colocation group; a worker alone has group == name
    min_threads: int = 1  # dedicated CPU threads it cannot work without
    uses_accelerator: bool = True  # False: CPU only even on a GPU inventory (the verifier)
    # Processes it runs as, one GPU each, each needing memory_bytes (a sharded learner: N; a
    # policy's generator or unsharded learner: 1). None: its memory may be spread evenly over
    # however many GPUs the planner gives it (a worker described only by its total).
    ranks: int | None = None  # processes on one GPU each; None: spread over any number

    @property
    def total_memory_bytes(self) -> int:
        return self.memory_bytes * (self.ranks or 1)

    @property
    def cost(self) -> float:
        """Estimated FLOPs per step (the weight of this worker in the proportional split)."""
        return float(FLOPS_PER_PARAM_TOKEN[self.role]) * self.num_parameters * self.tokens_per_step


class Inventory(msgspec.Struct, frozen=True, kw_only=True):
    """Homogeneous nodes: each has the same GPUs, cores and host memory."""

    nodes: int
    gpus_per_node: int
    gpu_memory_bytes: int
    cpus_per_node: int
    host_memory_bytes: int
    source: str = "described"  # "described" (config) or "detected" (this machine)

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def cpu_only(self) -> bool:
        return self.gpus_per_node == 0


def inventory_from_config(inv: InventoryConfig) -> Inventory:
    return Inventory(
        nodes=inv.nodes,
        gpus_per_node=inv.gpus_per_node,
        gpu_memory_bytes=int(inv.gpu_memory_gb * GIB),
        cpus_per_node=inv.cpus_per_node,
        host_memory_bytes=int(inv.host_memory_gb * GIB),
        source="described",
    )


def detect_inventory() -> Inventory:
    """This machine as a one-node inventory (CUDA GPUs via torch, cores we may run on, RAM)."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    # Heterogeneous GPUs on one node: plan with the smallest so every placement fits.
    mem = min((torch.cuda.get_device_properties(i).total_memory for i in range(gpus)), default=0)
    try:
        cpus = len(os.sched_getaffinity(0))  # honours taskset/cgroup pinning, unlike cpu_count
    except AttributeError:
        cpus = os.cpu_count() or 1
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Inventory(
        nodes=1,
        gpus_per_node=gpus,
        gpu_memory_bytes=mem or GIB,
        cpus_per_node=cpus,
        host_memory_bytes=host,
        source="detected",
    )


def resolve_inventory(alloc: AllocationConfig) -> Inventory:
    return inventory_from_config(alloc.inventory) if alloc.inventory else detect_inventory()


# ---- memory estimates (pure) --------------------------------------------------------------------


def learner_memory_bytes(
    num_parameters: int, mem: MemoryModel, *, reference: bool, lora: bool, ranks: int = 1
) -> int:
    """Weights + gradients + optimizer state (+ a frozen reference copy when KL is on), on each
    of ``ranks`` ranks: a sharded learner holds 1/ranks of each (rounded up)."""
    if lora:
        # Only adapters train; the reference is the base with adapters disabled, so it is free.
        return num_parameters * mem.weight_bytes
    per_param = mem.weight_bytes + mem.grad_bytes + mem.optimizer_bytes
    return -(-num_parameters * (per_param + (mem.weight_bytes if reference else 0)) // ranks)


def kv_cache_bytes(num_layers: int, kv_width: int, tokens: int, mem: MemoryModel) -> int:
    """K and V for every layer and token resident at once. ``kv_width`` = num_key_value_heads x
    head_dim: the hidden size without grouped-query attention, a fraction of it with."""
    return 2 * num_layers * kv_width * mem.weight_bytes * tokens


def activation_bytes(
    d: Dims, rows: int, seq_len: int, completion_len: int, act_bytes: int, checkpointing: bool
) -> int:
    """Activations one learner micro-batch keeps for backward (peak, one micro-batch at a time).

    Values stored per token and decoder layer (attention scores are not stored: SDPA and flash
    attention recompute them): attention block 4h + 2kv (norm input, q/k/v projections' input,
    q, k, v, o_proj input), MLP block 2h + 4i (norm input and output, gate, up, act(gate),
    down_proj input): 6h + 2kv + 4i in all. With gradient checkpointing only each layer's input
    (h) is kept, plus one layer's values while it is recomputed. The LM head's fp32 logits and
    log-softmax at the completion positions add rows x completion_len x vocab x 8 bytes.
    """
    per_layer = 6 * d.hidden + 2 * d.kv_width + 4 * d.intermediate
    kept = d.layers * d.hidden + per_layer if checkpointing else d.layers * per_layer
    return rows * seq_len * act_bytes * kept + rows * completion_len * d.vocab * 8


def gathered_bytes(d: Dims, tied: bool, mem: MemoryModel) -> int:
    """What a rank of a sharded learner holds whole for a moment, beyond its shards: its largest
    FSDP unit gathered (parameters at weight_bytes), their gradients (grad_bytes) and the fp32
    copy the reduction takes of them. The root unit holds the embedding (and an untied LM head),
    at large vocabularies the largest; a decoder layer otherwise."""
    root = d.vocab * d.hidden * (1 if tied else 2) + d.hidden
    layer = 2 * d.hidden * (d.hidden + d.kv_width) + 3 * d.hidden * d.intermediate + 2 * d.hidden
    return max(root, layer) * (mem.weight_bytes + mem.grad_bytes + 4)


def generator_memory_bytes(num_parameters: int, kv_bytes: int, mem: MemoryModel) -> int:
    return num_parameters * mem.weight_bytes + kv_bytes


def engine_reservation_bytes(gpu_memory_utilization: float, gpu_memory_bytes: int) -> int:
    """A vLLM engine preallocates this share of its GPU (weights, KV cache, activations) up front,
    whatever the model needs: that, not the estimate of the torch sampler, is what it takes."""
    return int(gpu_memory_utilization * gpu_memory_bytes)


def check_engine_fits(reserved_bytes: int, weight_bytes: int, where: str) -> None:
    """An engine whose reservation cannot even hold the weights fails at startup: say so now."""
    if reserved_bytes <= weight_bytes:
        raise ConfigError(
            f"{where}.gpu_memory_utilization reserves {reserved_bytes / GIB:.2f} GiB, "
            "not more than "
            f"the model's {weight_bytes / GIB:.2f} GiB of weights: the vLLM engine would have no "
            f"room for its KV cache; raise it"
        )


def tokens_per_step(
    prompts_per_step: int, num_generations: int, prompt_length: int, completion_length: int
) -> int:
    """Every completion of the step carries its prompt: B x G x (prompt + completion)."""
    return prompts_per_step * num_generations * (prompt_length + completion_length)


# ---- from a run config --------------------------------------------------------------------------


def _default_counter(policy, vocab_size: int) -> int:
    from mutualrl.policies.models import count_parameters

    return count_parameters(policy, vocab_size)


def _default_vocab(tokenizer: str) -> int:
    from mutualrl.retokenize.loaders import load_tokenizer

    return load_tokenizer(tokenizer).vocab_size


def _apply_override(spec: WorkerSpec, alloc: AllocationConfig) -> WorkerSpec:
    o = alloc.workers.get(spec.name)
    if o is None:
        return spec
    changes: dict = {}
    if o.num_parameters is not None:
        changes["num_parameters"] = o.num_parameters
    if o.tokens_per_step is not None:
        changes["tokens_per_step"] = o.tokens_per_step
    if o.memory_gb is not None:
        changes["memory_bytes"] = int(o.memory_gb * GIB)
    return msgspec.structs.replace(spec, **changes)


def _count(p, alloc: AllocationConfig, count_params, vocab_size) -> int:
    from mutualrl.policies.checkpoints import read_checkpoint_config

    if p.checkpoint and read_checkpoint_config(p) is None:
        raise ConfigError(
            f"allocation.num_parameters.{p.name}: checkpoint {p.checkpoint!r} is not "
            "on this machine; give its parameter count there"
        )
    return count_params(p, vocab_size(p.tokenizer))


def learner_activation_bytes(
    cfg: RunConfig, alloc: AllocationConfig, dims: Dims, ranks: int = 1
) -> int:
    """``activation_bytes`` for the run's micro-batch on one rank: rows and checkpointing from
    ``[allocation.memory]``, else from the update engine's settings in ``[training]``, else one
    batch of every own sequence of a step, shared by ``ranks`` ranks, without checkpointing (peer
    rows a strategy adds are not counted)."""
    g, t, mem = cfg.grpo, cfg.training, alloc.memory
    rows = (
        mem.micro_batch_rows
        or t.per_device_train_batch_size
        or -(-g.prompts_per_step * g.num_generations // ranks)
    )
    ckpt = (
        mem.gradient_checkpointing
        if mem.gradient_checkpointing is not None
        else t.gradient_checkpointing
    )
    return activation_bytes(
        dims,
        rows,
        alloc.prompt_length_estimate + g.max_completion_length,
        g.max_completion_length,
        mem.activation_bytes or mem.weight_bytes,
        ckpt,
    )


def worker_specs_from_config(
    cfg: RunConfig,
    alloc: AllocationConfig | None = None,  # None: cfg.allocation
    *,
    count_params: Callable[[object, int], int] = _default_counter,
    vocab_size: Callable[[str], int] = _default_vocab,
) -> list[WorkerSpec]:
    """One learner and one generator per policy (a colocation group unless ``colocate=false``),
    then a verifier. Parameter counts come from ``[allocation.num_parameters]`` when given (real
    checkpoints not on this machine), else from the architecture on the meta device; the vocabulary
    size is only needed then. ``count_params``/``vocab_size`` are injectable for tests."""
    alloc = alloc or cfg.allocation
    vocab_size = functools.cache(vocab_size)
    g = cfg.grpo
    tokens = tokens_per_step(
        g.prompts_per_step, g.num_generations, alloc.prompt_length_estimate, g.max_completion_length
    )
    specs: list[WorkerSpec] = []
    for i, p in enumerate(cfg.policies):
        n = alloc.num_parameters.get(p.name) or _count(p, alloc, count_params, vocab_size)
        learner_mem, gen_mem = _policy_memory(cfg, alloc, i, n, tokens, vocab_size)
        # the generator is rank 0's copy of the weights (or one engine): one GPU
        roles: tuple[tuple[Role, int, int, int | None], ...] = (
            ("learner", tokens * g.num_iterations, learner_mem, p.learner_ranks),
            ("generator", tokens, gen_mem, 1),
        )
        for role, role_tokens, memory, role_ranks in roles:
            name = f"{p.name}/{role}"
            specs.append(
                WorkerSpec(
                    name=name,
                    role=role,
                    policy=p.name,
                    num_parameters=n,
                    tokens_per_step=role_tokens,
                    memory_bytes=memory,
                    group=p.name if alloc.colocate else name,
                    ranks=role_ranks,
                )
            )
    specs.append(
        WorkerSpec(
            name="verifier",
            role="verifier",
            policy=None,
            num_parameters=0,
            tokens_per_step=tokens * len(cfg.policies),
            memory_bytes=0,
            group="verifier",
            min_threads=alloc.verifier_threads,
            uses_accelerator=False,
        )
    )
    return [_apply_override(s, alloc) for s in specs]


def _policy_memory(
    cfg: RunConfig, alloc: AllocationConfig, i: int, n: int, tokens: int, vocab_size
) -> tuple[int, int]:
    """(each learner rank's memory, the generator's) for policy ``i`` of ``n`` parameters."""
    g, mem, p = cfg.grpo, alloc.memory, cfg.policies[i]
    dims = resolve_dims(p, alloc, vocab_size)
    # a torch sampler holds grpo.generation_batch_size sequences at once; an engine, what
    # allocation.generation_batch_tokens caps
    per_pass = (
        g.generation_batch_size * (alloc.prompt_length_estimate + g.max_completion_length)
        if g.generation_batch_size
        else tokens
    )
    resident = min(tokens, per_pass, alloc.generation_batch_tokens or tokens)
    kv = kv_cache_bytes(dims.layers, dims.kv_width, resident, mem)
    ranks = p.learner_ranks
    learner = learner_memory_bytes(
        n, mem, reference=g.beta > 0, lora=p.lora is not None, ranks=ranks
    ) + learner_activation_bytes(cfg, alloc, dims, ranks)
    if ranks > 1:
        learner += gathered_bytes(dims, tied_embeddings(p, alloc), mem)
    gen = generator_memory_bytes(n, kv, mem)
    if p.generation.backend == "vllm" and p.generation.kv_cache_memory_bytes is not None:
        # a KV cache of fixed bytes (vLLM's CPU build needs one): the engine allocates that
        # beside its weights, and gpu_memory_utilization is not read
        gen = generator_memory_bytes(n, p.generation.kv_cache_memory_bytes, mem)
    elif p.generation.backend == "vllm":
        gen = engine_reservation_bytes(
            p.generation.gpu_memory_utilization, resolve_inventory(alloc).gpu_memory_bytes
        )
        check_engine_fits(gen, n * mem.weight_bytes, f"$.policies[{i}].generation")
    if p.generation.backend == "vllm" and ranks > 1:
        gen += n * mem.weight_bytes  # rank 0's whole copy the engine reloads from (sharded.mirror)
    return learner, gen
