"""A learner's state on disk, whatever its rank count: checkpoints with torch.distributed.checkpoint
and whole-state files in the one-rank format.

**Sharded checkpoints** (``save_sharded``; a policy's part of a run checkpoint when it has
several ranks): ``<dir>/dcp/`` holds the model, the AdamW state and the KL reference as each
rank's shards (``torch.distributed.checkpoint``, keyed by parameter name, not by rank), and
``<dir>/learner.pt`` what is not sharded (schedule, version, skipped steps, the sampler's
generator; written by rank 0). ``load_sharded`` reads it into a learner of *any* rank count,
one included (a one-rank learner in a process without a process group reads the whole tensors):
the checkpoint reshards on load. Nothing in it is read as code: ``learner.pt`` with
``weights_only``, the shards' metadata by ``dcp_reader`` (torch's own reader unpickles it). The
run checkpoint around it (``run.checkpoint``) is written into a temporary folder, checksummed in
its manifest and renamed into place, as for one rank.

**Whole-state files** (``full_state`` / ``load_full_state``): the one-rank ``Policy.save_state``
format (``model``, ``optimizer`` with parameters numbered in order, ``scheduler``, ``version``,
``skipped_nan_steps``), gathered tensor by tensor to rank 0, and read back by rank 0 and
broadcast to the shards. A one-rank checkpoint (``state.pt`` + ``reference.pt``) resumes a
sharded learner this way, and warm-start cache files are the same for every rank count.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist

# torch.distributed.checkpoint is imported where it is used: every policy process imports this
# module, and only sharded ones (or a resume across rank counts) need it.

DCP_DIR = "dcp"
META = "learner.pt"


def _grouped() -> bool:
    """Whether this process is a rank of a process group (a one-rank learner is not)."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if _grouped() else 0


def is_sharded_checkpoint(directory: str | Path) -> bool:
    """Whether a policy's checkpoint folder was written by ``save_sharded``."""
    return (Path(directory) / DCP_DIR).is_dir()


def _learner_state(learner) -> dict:
    """The keys a sharded checkpoint holds, as state dicts of this learner (loading fills them)."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    state = {
        "model": get_model_state_dict(learner.model),
        "optimizer": get_optimizer_state_dict(learner.model, learner.optimizer),
    }
    if learner.reference is not None:
        state["reference"] = get_model_state_dict(learner.reference)
    return state


def save_sharded(learner, directory: str | Path, extra: dict) -> None:
    """Every rank writes its shards into ``directory/dcp``; rank 0 writes ``learner.pt`` with the
    rest and ``extra`` (e.g. the sampler's generator state)."""
    import torch.distributed.checkpoint as dcp

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    dcp.save(_learner_state(learner), checkpoint_id=str(d / DCP_DIR), no_dist=not _grouped())
    if rank() == 0:
        torch.save(
            {
                "format": "dcp",
                "name": learner.name,
                "ranks": learner.placement.share.world,
                "scheduler": learner.scheduler.state_dict(),
                "version": learner.version,
                "skipped_nan_steps": learner.skipped_nan_steps,
                **extra,
            },
            d / META,
        )


def load_sharded(learner, directory: str | Path) -> dict:
    """Load a ``save_sharded`` folder into ``learner`` (any rank count); ``learner.pt`` out."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from mutualrl.policies.dcp_reader import SafeFileSystemReader

    d = Path(directory)
    meta = torch.load(d / META, map_location="cpu", weights_only=True)
    if meta.get("name") != learner.name:
        raise ValueError(
            f"{d}: holds the state of policy {meta.get('name')!r}, not {learner.name!r}"
        )
    state = _learner_state(learner)
    with warnings.catch_warnings():
        # a one-rank learner reads the shards whole in a process without a group, on purpose
        warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled")
        # the shards' metadata read as data, not by torch's plain pickle.load (dcp_reader)
        dcp.load(
            state,
            checkpoint_id=str(d / DCP_DIR),
            no_dist=not _grouped(),
            storage_reader=SafeFileSystemReader(d / DCP_DIR),
        )
    set_model_state_dict(learner.model, state["model"])
    set_optimizer_state_dict(learner.model, learner.optimizer, state["optimizer"])
    if learner.reference is not None:
        set_model_state_dict(learner.reference, state["reference"])
    _set_counters(learner, meta)
    return meta


def _set_counters(learner, state: dict) -> None:
    learner.scheduler.load_state_dict(state["scheduler"])
    learner.version, learner.skipped_nan_steps = (
        int(state["version"]),
        int(state["skipped_nan_steps"]),
    )


def _trained_names(model: torch.nn.Module) -> list[str]:
    """Trained parameters' names in the order the optimizer numbers them (``make_optimizer``)."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


def full_state(learner) -> dict | None:
    """The learner's whole state in the one-rank format: on rank 0 (gathered there tensor by
    tensor, in host memory); None on the other ranks, which must call this too."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model = get_model_state_dict(learner.model, options=opts)
    # {"state": {name: moments}, "param_groups": [{..., "params": [names]}]}: the optimizer's
    # state dict, keyed by parameter names (torch's type is the union of its two parts)
    by_name = cast(dict, get_optimizer_state_dict(learner.model, learner.optimizer, options=opts))
    if rank() != 0:
        return None
    number = {n: i for i, n in enumerate(_trained_names(learner.model))}
    optim = {
        "state": {number[n]: v for n, v in by_name["state"].items()},
        "param_groups": [
            {**g, "params": [number[n] for n in g["params"]]} for g in by_name["param_groups"]
        ],
    }
    return {
        "model": model,
        "optimizer": optim,
        "scheduler": learner.scheduler.state_dict(),
        "version": learner.version,
        "skipped_nan_steps": learner.skipped_nan_steps,
    }


def load_full_state(learner, state: dict | None, reference: dict | None = None) -> dict:
    """Load a one-rank-format state (rank 0 passes it, the others None) into every shard; the
    counters and schedule go to every rank. ``reference``: the frozen KL reference's weights
    (rank 0), when the learner has one. Returns the state's small entries, on every rank."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    first = rank() == 0
    full = cast(dict, state)  # read on rank 0 only, which passes it
    small: list[dict | None] = [None]
    if first:
        small = [
            {
                **{k: v for k, v in full.items() if k not in ("model", "optimizer")},
                "has_reference": reference is not None,
                "param_groups": full["optimizer"]["param_groups"],
                "moments": bool(full["optimizer"]["state"]),
            }
        ]
    dist.broadcast_object_list(small, src=0)
    meta = cast(dict, small[0])  # rank 0's, on every rank now
    set_model_state_dict(learner.model, full["model"] if first else {}, options=opts)
    if meta["moments"]:
        names = _trained_names(learner.model)
        optim: dict = {}
        if first:
            o = full["optimizer"]
            optim = {
                "state": {names[int(i)]: v for i, v in o["state"].items()},
                "param_groups": [
                    {**g, "params": [names[int(i)] for i in g["params"]]} for g in o["param_groups"]
                ],
            }
        set_optimizer_state_dict(learner.model, learner.optimizer, optim, options=opts)
    else:
        # no moments yet (saved before the first step): the optimizer starts afresh, as a
        # one-rank one would (loading through the sharded path would leave its set-up step's)
        learner.optimizer.load_state_dict({"state": {}, "param_groups": meta["param_groups"]})
    if learner.reference is not None and meta["has_reference"]:
        # rank 0's reference is there: has_reference says so
        set_model_state_dict(
            learner.reference, cast(dict, reference) if first else {}, options=opts
        )
    _set_counters(learner, meta)
    return meta
