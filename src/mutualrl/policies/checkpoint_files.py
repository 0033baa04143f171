"""A checkpoint folder's files read before the run folder is written: one line per cause.

``check_checkpoint`` (``policies.checkpoints``) checks config.json; this checks what a worker
would otherwise find broken only after the run folder was written (so that the next try is
refused as "already holds a run" for a run that never took a step), with a traceback from deep
inside safetensors, torch or tokenizers:

- no weights (``model.safetensors``, ``pytorch_model.bin``, or a sharded index of either);
- a safetensors file cut short or corrupt: its header is read (not its tensors), and
  safetensors itself checks that the header's offsets cover the file exactly;
- a ``.bin`` whose pickle holds code: read with torch's ``weights_only`` unpickler (memory
  mapped, so no tensor is copied), which refuses any global outside its allow-list before
  calling it; nothing of the file runs, and the line says so and suggests safetensors;
- a folder that is its policy's tokenizer but holds no tokenizer file;
- weights that load but do not fit ``config.json`` (``check_fit``): a tensor whose shape is not
  the one the config builds, or tensors the config builds that the files lack
  (``from_pretrained`` would refuse the first with a table and silently initialise the second at
  random). Judged by transformers' own load onto the meta device, which maps checkpoint names
  (GPT-NeoX's ``embed_out``) as a real load does and reads no tensor.
"""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path
from typing import cast

from mutualrl.config import ConfigError, PolicyConfig

SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
PICKLE, PICKLE_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
# What AutoTokenizer builds a fast tokenizer from (a tokenizer_config.json alone is not one).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "tekken.json")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def weight_files(folder: Path, field: str) -> list[Path]:
    """The weight files ``from_pretrained`` would read, safetensors first as it prefers them."""
    for single, index in ((SAFETENSORS, SAFETENSORS_INDEX), (PICKLE, PICKLE_INDEX)):
        if (folder / single).is_file():
            return [folder / single]
        if (folder / index).is_file():
            try:
                weight_map = json.loads((folder / index).read_text())["weight_map"]
                shards = sorted(set(weight_map.values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                raise ConfigError(f"{field}: {folder / index} is unreadable ({exc})") from None
            missing = [s for s in shards if not (folder / s).is_file()]
            if missing:
                raise ConfigError(f"{field}: {folder / index} names shards not there: {missing}")
            return [folder / s for s in shards]
    raise ConfigError(
        f"{field}: {folder} has no weights (expected {SAFETENSORS} or {PICKLE}, or a sharded "
        f"index of them, as save_pretrained writes)"
    )


def _check_safetensors(path: Path, field: str) -> None:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt"):
            pass
    except (SafetensorError, OSError) as exc:
        raise ConfigError(
            f"{field}: {path} is truncated or corrupt (safetensors: {_first_line(exc)}); "
            "copy it again from where it came from"
        ) from None


def _check_pickle(path: Path, field: str) -> None:
    import torch

    try:
        try:
            torch.load(str(path), weights_only=True, mmap=True, map_location="cpu")
        except RuntimeError as exc:  # an old (non-zip) file cannot be memory mapped
            if "mmap" not in str(exc):
                raise
            torch.load(str(path), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        found = re.search(r"GLOBAL (\S+)", str(exc))
        what = f"it calls {found.group(1)}" if found else _first_line(exc)
        raise ConfigError(
            f"{field}: {path} holds pickled code, refused by torch's weights-only loader "
            f"({what}); nothing of it was run; use weights saved as safetensors "
            f"({SAFETENSORS}: model.save_pretrained writes it) from a source you trust"
        ) from None
    except (RuntimeError, OSError, EOFError, ValueError) as exc:
        raise ConfigError(
            f"{field}: {path} is truncated or corrupt ({_first_line(exc)}); copy it again"
        ) from None


def check_folder_files(p: PolicyConfig, folder: Path) -> None:
    """``folder`` (``p.checkpoint``) has readable weights, and a tokenizer where ``p`` takes
    its tokenizer from it; else one ``ConfigError`` naming the policy, the file and the cause."""
    field = f"policies.{p.name}.checkpoint"
    for path in weight_files(folder, field):
        if path.suffix == ".safetensors":
            _check_safetensors(path, field)
        else:
            _check_pickle(path, field)
    check_fit(field, folder)  # after the files: nothing unchecked is unpickled
    if p.tokenizer == p.checkpoint and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise ConfigError(
            f"policies.{p.name}.tokenizer: {folder} has no tokenizer files (expected one of "
            f"{', '.join(TOKENIZER_FILES)}, as a tokenizer's save_pretrained writes); copy "
            "them in, or set tokenizer to a folder or packaged tokenizer that has them"
        )


def check_fit(field: str, folder: Path) -> None:
    """The weights' tensors are those ``config.json`` builds: same shapes, none missing, as
    transformers' load onto the meta device reports them."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its load report would repeat, as a table, what we say
    hf_logging.disable_progress_bar()
    try:
        loaded = AutoModelForCausalLM.from_pretrained(
            folder, device_map="meta", output_loading_info=True, ignore_mismatched_sizes=True
        )
        info = cast(dict, loaded[1])  # type: ignore[index]
    except Exception:  # noqa: BLE001 - a load transformers refuses: the worker's load says why
        return
    finally:
        hf_logging.set_verbosity(level)
        hf_logging.enable_progress_bar()
    mismatched = sorted(info["mismatched_keys"], key=lambda m: m[0])
    if mismatched or info["missing_keys"]:
        raise ConfigError(misfit(field, folder, mismatched, info["missing_keys"]))


def misfit(field: str, folder, mismatched, missing) -> str:
    """The line for weights that do not fit their config: ``mismatched`` as (name, shape in the
    weights, shape by the config), ``missing`` the names the config builds and the files lack."""
    what = []
    if mismatched:
        k, found, wanted = mismatched[0]
        what.append(
            f"{len(mismatched)} tensor(s) of another shape than config.json builds ({k}: "
            f"{_shape(found)} in the weights, {_shape(wanted)} by the config)"
        )
    if missing:
        first = sorted(missing)[0]
        what.append(
            f"{len(missing)} tensor(s) the config builds are not in the weights ({first}, ...)"
        )
    return (
        f"{field}: the weights of {folder} do not fit its config.json: {'; '.join(what)}; "
        "expected the config.json saved with these weights"
    )


def _shape(shape) -> str:
    return " x ".join(map(str, tuple(shape))) or "scalar"
