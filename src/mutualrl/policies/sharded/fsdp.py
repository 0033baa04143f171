"""The ``Sharded`` placement: one rank's shard of a policy's model, wrapped with FSDP2.

Built without ever holding the whole model on a rank that does not need it: every rank builds
the model's structure on the meta device, wraps it with ``fully_shard`` per decoder layer (the
classes the model names in ``_no_split_modules``) and then at the root, over a one-dimensional
``DeviceMesh`` of the learner's ranks, and allocates only its shard. Rank 0 alone builds the
whole model as a one-rank learner would (seeded random weights or the checkpoint): its weights
are broadcast to the shards tensor by tensor (``set_model_state_dict`` with
``broadcast_from_rank0``), and it stays on rank 0 as the generator's copy (``mirror``). Buffers
(rotary frequencies) are not in a state dict: they are broadcast from rank 0's model too.

Gradients: FSDP2 averages a reduction over the ranks by default. Here every micro-batch's loss is
already its share of the whole batch's loss, so the reduction must *sum*: every FSDP module gets
divide factor 1 and sum-only collectives, and the reduced gradient is the one-rank gradient.

Precision: a ``bf16`` policy gets FSDP2's ``MixedPrecisionPolicy``: parameters gathered and used
in bf16, fp32 sharded master weights and AdamW state, gradients reduced in fp32. CPU offload
(``sharding.cpu_offload``) keeps the shards, their gradients and the optimizer step in host RAM.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from mutualrl.config import ShardingConfig
from mutualrl.policies.models import TokenizerFacts, build_model, empty_model
from mutualrl.policies.sharded.share import GroupShare
from mutualrl.policies.update import prepare_model


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers: modules of the classes it names as not to be split."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} names no decoder layer classes "
            f"(_no_split_modules = {sorted(names)}): it cannot be sharded per layer"
        )
    return layers


def shard(
    model: torch.nn.Module, mesh, sharding: ShardingConfig, bf16: bool, frozen: bool = False
) -> torch.nn.Module:
    """``fully_shard`` per decoder layer, then the root; reductions sum (see the module docstring).

    The root of a trained model keeps its gathered parameters from forward to backward (FSDP2's
    default: backward needs them at once); a ``frozen`` one (the KL reference) has no backward
    and frees them after each forward."""
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16
        else MixedPrecisionPolicy()
    )
    offload = CPUOffloadPolicy() if sharding.cpu_offload else OffloadPolicy()
    for layer in decoder_layers(model):
        fully_shard(
            layer,
            mesh=mesh,
            mp_policy=mp,
            offload_policy=offload,
            reshard_after_forward=sharding.reshard_after_forward,
        )
    fully_shard(
        model,
        mesh=mesh,
        mp_policy=mp,
        offload_policy=offload,
        reshard_after_forward=True if frozen else None,
    )
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    return model


class Sharded:
    """Rank ``rank`` of a learner sharded over ``world`` ranks (the default process group)."""

    autocast = False  # FSDP2's mixed precision casts; no autocast on top
    # every rank's forward gathers the shards: passes whose count or shape follow a rank's rows
    # (a shared prompt's) could leave ranks waiting on each other
    collective = True

    def __init__(self, rank: int, world: int, device: str, sharding: ShardingConfig) -> None:
        self.rank, self.world, self.sharding = rank, world, sharding
        self.share = GroupShare(rank, world, torch.device(device))
        self.full: torch.nn.Module | None = None  # rank 0: the whole model (the generator's copy)

    def build(self, learner, facts: TokenizerFacts, seed: int):
        cfg, device = learner.cfg, learner.device
        mesh = init_device_mesh(device.type, (self.world,))
        if self.rank == 0:
            self.full = build_model(cfg, facts, seed)
        full_state = self.full.state_dict() if self.full is not None else {}
        bf16 = cfg.dtype == "bf16"
        model = empty_model(cfg, facts)
        prepare_model(model, learner.training)
        models = [model]
        if learner.grpo.beta > 0:
            models.append(empty_model(cfg, facts).eval().requires_grad_(False))
        for m in models:
            shard(m, mesh, self.sharding, bf16, frozen=m is not model)
            m.to_empty(device="cpu" if self.sharding.cpu_offload else device)
            # each load consumes the dict it is given: a fresh one per model
            set_model_state_dict(
                m,
                dict(full_state),
                options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
            )
            self._broadcast_buffers(m, device)
        if self.full is not None:
            # the generator's copy in the policy's compute precision: what the plan counts for it
            self.full.to(device=device, dtype=torch.bfloat16 if bf16 else torch.float32).eval()
        return model, (models[1] if len(models) > 1 else None)

    def _broadcast_buffers(self, model: torch.nn.Module, device: torch.device) -> None:
        """Buffers are computed at construction (on meta: not at all): take rank 0's, on the
        compute device (with CPU offload the shards stay in host memory, buffers do not)."""
        source = dict(self.full.named_buffers()) if self.full is not None else {}
        with torch.no_grad():
            for prefix, module in model.named_modules():
                for name, buf in list(module._buffers.items()):
                    if buf is None:
                        continue
                    full_name = f"{prefix}.{name}" if prefix else name
                    t = (source[full_name] if self.rank == 0 else buf).to(device).clone()
                    dist.broadcast(t, src=0)
                    module._buffers[name] = t


def settle(model: torch.nn.Module) -> None:
    """Free what a forward without backward left gathered (the root's parameters), so the
    model registers its shards again and holds no whole tensor while others use the memory."""
    if isinstance(model, FSDPModule):
        model.reshard()
