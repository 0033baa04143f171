"""Converted packaged models: one ``from_pretrained`` folder per model, built once, checked always.

A packaged model's GGUF file (``policies.packaged``) took 18-48 s (SmolLM2) and 32-44 s (Gemma 3)
to convert on 2 busy cores, and a GGUF-loaded model cannot be saved as it is ("quantized with gguf
and is not serializable").
So it is converted once: the de-quantized weights go into a model built from the same config
without its ``quantization_config``, saved as fp32 safetensors with the tokenizer (and its chat
template, where the GGUF has one) — a folder ``from_pretrained`` reads in seconds.

Cache: ``models_dir()`` = ``$MUTUALRL_CACHE/models`` (default ``~/.cache/mutualrl/models``), one
folder per model and source digest. A folder is built in a temporary sibling and renamed into
place, its manifest (every file's size and sha256) written last; a folder whose manifest is
missing or disagrees with its files is partial or corrupt: it is removed and rebuilt, never
loaded. Builders of the same model take a file lock, so concurrent runs convert once.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import json
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Protocol

from mutualrl.config import ConfigError, PolicyConfig
from mutualrl.policies.checkpoints import save_pretrained_quietly
from mutualrl.policies.packaged import (
    CONVERSION_VERSION,
    MANIFEST,
    PACKAGED_MODELS,
    PackagedModel,
    PackagedModelError,
    cache_folder,
    is_packaged_name,
    locate,
    models_dir,
    recorded_sha256,
    verified_gguf,
)


class Stages(Protocol):
    """What the conversion reports to (``run.progress.RunProgress`` is one)."""

    def start_phase(self, phase: str, total: int, completed: int = 0) -> None: ...
    def advance(self, description: str = "") -> None: ...
    def finish_phase(self, message: str) -> None: ...


class _Silent:
    def start_phase(self, phase: str, total: int, completed: int = 0) -> None:
        pass

    def advance(self, description: str = "") -> None:
        pass

    def finish_phase(self, message: str) -> None:
        pass


class LineStages:
    """Stages as plain lines on stderr, for callers without a live display (``compare``)."""

    def __init__(self) -> None:
        self.phase, self.t0 = "", time.perf_counter()

    def start_phase(self, phase: str, total: int, completed: int = 0) -> None:
        self.phase, self.t0 = phase, time.perf_counter()

    def advance(self, description: str = "") -> None:
        print(
            f"mutualrl: {self.phase} [{time.perf_counter() - self.t0:.0f}s]: {description}",
            file=sys.stderr,
            flush=True,
        )

    def finish_phase(self, message: str) -> None:
        print(f"mutualrl: {message}", file=sys.stderr, flush=True)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def _files(folder: Path) -> dict[str, Path]:
    return {
        p.relative_to(folder).as_posix(): p
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }


def write_manifest(folder: Path, source: dict) -> None:
    """Record every file's size and sha256; written last, so its presence marks a whole folder."""
    files = {
        name: {"size": p.stat().st_size, "sha256": _sha256(p)} for name, p in _files(folder).items()
    }
    (folder / MANIFEST).write_text(
        json.dumps({"version": CONVERSION_VERSION, "source": source, "files": files}, indent=1)
    )


def folder_problem(folder: Path) -> str | None:
    """Why ``folder`` is not a complete, intact converted model (None: it is)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        recorded = manifest["files"]
    except FileNotFoundError:
        return "no manifest (a partial conversion)"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"unreadable manifest ({exc})"
    present = _files(folder)
    if set(present) != set(recorded):
        return f"files differ from the manifest: {sorted(set(present) ^ set(recorded))}"
    for name, path in present.items():
        if (
            path.stat().st_size != recorded[name]["size"]
            or _sha256(path) != recorded[name]["sha256"]
        ):
            return f"{name} does not match its manifest hash"
    return None


@contextmanager
def _locked(name: str):
    models_dir().mkdir(parents=True, exist_ok=True)
    with (models_dir() / f".{name}.lock").open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextmanager
def _quiet_gguf_bar():
    """transformers' GGUF loader draws a tqdm bar of its own, outside its progress-bar switch,
    which would tear through the caller's display (the stages say where the conversion is)."""
    loader: ModuleType | None
    try:
        from transformers import modeling_gguf_pytorch_utils

        loader = modeling_gguf_pytorch_utils
    except ImportError:
        loader = None
    bar = getattr(loader, "tqdm", None)
    if bar is None:
        yield
        return
    setattr(loader, "tqdm", functools.partial(bar, disable=True))  # noqa: B010
    try:
        yield
    finally:
        setattr(loader, "tqdm", bar)  # noqa: B010


@contextmanager
def _one_gguf_parse():
    """transformers reads the GGUF file three times (tokenizer, config, weights), each with a new
    ``gguf.GGUFReader``, which parses every metadata field: with Gemma 3's 262,144 tokens that is
    ~25 s a parse on 2 cores, 80% of the conversion. The file does not change between them, so
    one reader (read-only memory map) serves all three."""
    import gguf as gguf_package

    make = gguf_package.GGUFReader
    readers: dict = {}

    def reader(path, mode="r"):
        key = (str(path), mode)
        if key not in readers:
            readers[key] = make(path, mode)
        return readers[key]

    # replaced for the conversion only (setattr: the module's class, patched on purpose)
    setattr(gguf_package, "GGUFReader", reader)  # noqa: B010
    try:
        yield
    finally:
        setattr(gguf_package, "GGUFReader", make)  # noqa: B010


def convert_gguf(gguf: Path, out: Path) -> None:
    """De-quantize ``gguf`` into a ``from_pretrained`` folder ``out`` (fp32 safetensors, config
    without ``quantization_config``, tokenizer with its chat template where the file has one)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _one_gguf_parse(), _quiet_gguf_bar():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights below are plain fp32, not GGUF
    config.dtype = torch.float32
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict(), assign=True, strict=True)
    plain.tie_weights()
    plain.generation_config = loaded.generation_config
    save_pretrained_quietly(plain, out, tokenizer)


def _build(model: PackagedModel, digest: str, final: Path, stages: Stages) -> None:
    """Verify the source, convert into a temporary sibling of ``final``, then rename it in."""
    if importlib.util.find_spec("gguf") is None:
        raise PackagedModelError(
            f"packaged model {model.name!r}: converting its GGUF file needs "
            "the gguf package: pip install 'mutualrl[models]' (or: "
            "mutualrl models fetch NAME, which installs it)"
        )
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in final.parent.glob(f".{model.name}.build-*"):  # a killed build's (under the lock)
        shutil.rmtree(stale, ignore_errors=True)
    stages.start_phase(f"convert {model.name}", total=4)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=final.parent, prefix=f".{model.name}.build-") as tmp:
        work, out = Path(tmp) / "source", Path(tmp) / "folder"
        work.mkdir()
        stages.advance("verifying the packaged GGUF file")
        gguf = verified_gguf(model, work)
        stages.advance(f"de-quantizing {gguf.name} (under a minute on 2 cores)")
        convert_gguf(gguf, out)
        stages.advance("hashing the converted files")
        write_manifest(
            out,
            {
                "model": model.name,
                "gguf": model.gguf_name,
                "sha256": digest,
                "requirements": list(model.requirements),
            },
        )
        stages.advance("moving the folder into the cache")
        if final.exists():
            shutil.rmtree(final)  # found corrupt or partial by the caller, under the lock
        out.rename(final)
    stages.finish_phase(f"{model.name} converted in {time.perf_counter() - t0:.0f}s -> {final}")


def ensure_folder(name: str, stages: Stages | None = None) -> Path:
    """The converted folder of packaged model ``name``: the cached one when intact, else built
    now (verified first). Not installed: ``PackagedModelError`` with the install command."""
    return ensure_model_folder(PACKAGED_MODELS.get(name), stages)


def ensure_model_folder(model: PackagedModel, stages: Stages | None = None) -> Path:
    """``ensure_folder`` of a ``PackagedModel`` (registered or not)."""
    digest = recorded_sha256(model, locate(model))
    final = cache_folder(model, digest)
    if final.is_dir() and folder_problem(final) is None:
        return final
    with _locked(model.name):  # another process may have built it meanwhile
        if not (final.is_dir() and folder_problem(final) is None):
            _build(model, digest, final, stages or _Silent())
    return final


def resolve_checkpoint(spec: str | None, stages: Stages | None = None) -> str | None:
    """A checkpoint spec as a folder: a packaged name becomes its converted folder (built once);
    anything else is returned unchanged."""
    if spec is None or not is_packaged_name(spec):
        return spec
    return str(ensure_folder(spec, stages))


def resolve_policies(
    policies: list[PolicyConfig],
    stages: Stages | None = None,
    memo: dict[str | None, str | None] | None = None,
) -> list[PolicyConfig]:
    """``PolicyConfig``s with every packaged checkpoint name (and a tokenizer spec naming it)
    replaced by its converted folder, converting here, once, in the process that builds the run:
    workers, resumes and restarts then get and load the folder. ``memo``: names already resolved
    by this caller (each check re-hashes the folder: a compare of many runs checks once)."""
    import msgspec

    memo = {} if memo is None else memo
    resolved = []
    for p in policies:
        try:
            if p.checkpoint not in memo:
                memo[p.checkpoint] = resolve_checkpoint(p.checkpoint, stages)
            folder = memo[p.checkpoint]
        except PackagedModelError as exc:
            raise ConfigError(f"policies.{p.name}.checkpoint: {exc}") from None
        if folder == p.checkpoint:
            resolved.append(p)
            continue
        tokenizer = folder if p.tokenizer == p.checkpoint else p.tokenizer
        resolved.append(msgspec.structs.replace(p, checkpoint=folder, tokenizer=tokenizer))
    return resolved
