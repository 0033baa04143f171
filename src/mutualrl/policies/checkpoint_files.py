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
- safetensors weights that load but do not fit ``config.json`` (``check_fit``): a tensor whose
  shape is not the one the config builds, or tensors the config builds that the files lack
  (``from_pretrained`` would refuse the first and silently initialise the second at random).
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


def _check_safetensors(path: Path, field: str) -> dict[str, tuple[int, ...]]:
    """The file's tensor shapes, from its header (no tensor is read)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
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
    shapes: dict[str, tuple[int, ...]] | None = {}
    for path in weight_files(folder, field):
        if path.suffix == ".safetensors":
            found = _check_safetensors(path, field)
            shapes = None if shapes is None else {**shapes, **found}
        else:
            _check_pickle(path, field)
            shapes = None  # a pickle's shapes are not read without loading it
    if shapes:
        check_fit(field, folder, shapes)
    if p.tokenizer == p.checkpoint and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise ConfigError(
            f"policies.{p.name}.tokenizer: {folder} has no tokenizer files (expected one of "
            f"{', '.join(TOKENIZER_FILES)}, as a tokenizer's save_pretrained writes); copy "
            "them in, or set tokenizer to a folder or packaged tokenizer that has them"
        )


def expected_shapes(folder: Path) -> dict[str, tuple[int, ...]] | None:
    """The parameter shapes ``AutoModelForCausalLM`` builds from ``folder``'s config.json, on the
    meta device (nothing allocated); a tied parameter under its first name. None where the model
    cannot be built that way (its load then speaks for itself)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(folder)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001 - any failure here leaves the check to the real load
        return None
    return {name: tuple(t.shape) for name, t in model.named_parameters()}


def check_fit(field: str, folder: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    """The weights' tensors are those ``config.json`` builds: same shapes, none missing. Where
    the files name their tensors as the model does, judged from their headers; otherwise
    (GPT-NeoX's ``embed_out``, which transformers maps on load) by transformers' own load onto
    the meta device, which maps the names and reads no tensor."""
    expected = expected_shapes(folder)
    if not expected:
        return
    if not set(shapes) <= set(expected):
        _check_fit_by_load(field, folder)
        return
    wrong = [k for k in expected if k in shapes and shapes[k] != expected[k]]
    missing = [k for k in expected if k not in shapes]
    if not wrong and not missing:
        return
    what = []
    if wrong:
        k = wrong[0]
        what.append(
            f"{len(wrong)} tensor(s) of another shape than config.json builds ({k}: "
            f"{_shape(shapes[k])} in the weights, {_shape(expected[k])} by the config)"
        )
    if missing:
        what.append(
            f"{len(missing)} tensor(s) the config builds are not in the weights ({missing[0]}, ...)"
        )
    raise ConfigError(
        f"{field}: the weights of {folder} do not fit its config.json: {'; '.join(what)}; "
        "expected the config.json saved with these weights"
    )


def _shape(shape: tuple[int, ...]) -> str:
    return " x ".join(map(str, shape)) or "scalar"


def _check_fit_by_load(field: str, folder: Path) -> None:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its load report would repeat, as a table, what we say
    hf_logging.disable_progress_bar()
    try:
        loaded = AutoModelForCausalLM.from_pretrained(
            folder, device_map="meta", output_loading_info=True
        )
        info = cast(dict, loaded[1])  # type: ignore[index]
    except Exception as exc:  # noqa: BLE001 - a size mismatch, or a load transformers refuses
        raise ConfigError(
            f"{field}: the weights of {folder} do not fit its config.json ({_first_line(exc)}); "
            "expected the config.json saved with these weights"
        ) from None
    finally:
        hf_logging.set_verbosity(level)
        hf_logging.enable_progress_bar()
    missing = sorted(info["missing_keys"])
    if missing:
        raise ConfigError(
            f"{field}: the weights of {folder} do not fit its config.json: {len(missing)} "
            f"tensor(s) the config builds are not in the weights ({missing[0]}, ...); expected "
            "the config.json saved with these weights"
        )
