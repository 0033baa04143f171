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

Every load checks the folder again: by name (a fresh run, ``plan``, ``compare``), by path (a
resumed run's config.json holds the folder: ``reverify_folder``) and in the worker that loads it
(``verify_before_load``). The manifest's hashes and its ``source`` must be those of the packaged
model the folder is named for. A damaged folder is converted again with one line naming the file
that failed; one that cannot be (its package is gone) is an error naming the command that
restores it. A full disk while converting is one line naming the cache folder, the space needed
and left, and ``MUTUALRL_CACHE``; the temporary folder is removed.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import importlib.util
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
from mutualrl.policies.manifest import (
    folder_problem,
    remember,
    source_of,
    unchanged_since_verified,
    write_manifest,
)
from mutualrl.policies.packaged import (
    MANIFEST,
    PACKAGED_MODELS,
    PackagedModel,
    PackagedModelError,
    cache_folder,
    is_packaged_name,
    locate,
    models_dir,
    named_for,
    recorded_sha256,
    verified_gguf,
)
from mutualrl.storage import disk_full


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


@contextmanager
def _locked(name: str, parent: Path):
    parent.mkdir(parents=True, exist_ok=True)
    with (parent / f".{name}.lock").open("w") as handle:
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
    try:
        import gguf as gguf_package
    except ImportError:  # nothing to share: the conversion says it needs gguf
        yield
        return
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


# The tokenizer files and config a conversion writes beside the weights: Gemma 3's 262,144-token
# tokenizer.json is 33 MB; what the GGUF's tensors say the weights take is counted exactly.
_TOKENIZER_BYTES = 64 << 20


def conversion_bytes(gguf: Path) -> int | None:
    """What converting ``gguf`` writes: its tensors as fp32 plus the tokenizer's files (None:
    not known, the file is no GGUF the reader parses). Inside ``_one_gguf_parse`` this parse is
    the one the conversion then reads."""
    try:
        import gguf as gguf_package

        reader = gguf_package.GGUFReader(gguf, "r")
        return 4 * sum(int(t.n_elements) for t in reader.tensors) + _TOKENIZER_BYTES
    except Exception:  # noqa: BLE001 - any unreadable file: the space is not known beforehand
        return None


def _no_space(model: PackagedModel, where: Path, needed: int | None) -> PackagedModelError:
    free = shutil.disk_usage(where).free
    need = f"about {needed / 1e6:.0f} MB" if needed else "more space"
    return PackagedModelError(
        f"packaged model {model.name!r}: no space left on device converting it into {where}: "
        f"it needs {need}, {free / 1e6:.0f} MB are left; nothing half-written is kept; free "
        "some space or move the cache to a larger disk with MUTUALRL_CACHE=/path"
    )


def _build(model: PackagedModel, digest: str, final: Path, stages: Stages) -> None:
    """Verify the source, convert into a temporary sibling of ``final``, then rename it in. A
    full disk (checked first where the GGUF says what it takes) is one ``PackagedModelError``;
    the temporary folder goes either way, so nothing half-written is ever in the cache."""
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
    needed: int | None = None
    try:
        with (
            tempfile.TemporaryDirectory(dir=final.parent, prefix=f".{model.name}.build-") as tmp,
            _one_gguf_parse(),
        ):
            work, out = Path(tmp) / "source", Path(tmp) / "folder"
            work.mkdir()
            stages.advance("verifying the packaged GGUF file")
            gguf = verified_gguf(model, work)
            needed = conversion_bytes(gguf)
            if needed is not None and shutil.disk_usage(tmp).free < needed:
                raise OSError(errno.ENOSPC, "not enough space for the conversion", tmp)
            stages.advance(f"de-quantizing {gguf.name} (under a minute on 2 cores)")
            convert_gguf(gguf, out)
            stages.advance("hashing the converted files")
            write_manifest(out, source_of(model, digest))
            stages.advance("moving the folder into the cache")
            if final.exists():
                shutil.rmtree(final)  # found corrupt or partial by the caller, under the lock
            out.rename(final)
    except Exception as exc:
        # safetensors and tokenizers report ENOSPC as their own errors ("No space left on
        # device (os error 28)" in the message): storage.disk_full knows both
        if disk_full(exc, final.parent):
            raise _no_space(model, final.parent, needed) from None
        raise
    stages.finish_phase(f"{model.name} converted in {time.perf_counter() - t0:.0f}s -> {final}")


def _note(line: str) -> None:
    print(f"mutualrl: {line}", file=sys.stderr, flush=True)


def _ensure_at(model: PackagedModel, digest: str, final: Path, stages: Stages | None) -> Path:
    """``final``, the converted folder of ``model`` (GGUF sha256 ``digest``): checked, and
    rebuilt when missing, partial, damaged or another model's (the damage said in one line)."""
    if final.is_dir() and folder_problem(final, model, digest) is None:
        remember(final)
        return final
    with _locked(model.name, final.parent):  # another process may have built it meanwhile
        problem = folder_problem(final, model, digest) if final.exists() else "missing"
        if problem is None:
            remember(final)
            return final
        if problem != "missing":
            _note(f"the converted folder {final} is damaged ({problem}); converting it again")
        _build(model, digest, final, stages or _Silent())
    remember(final)
    return final


def ensure_folder(name: str, stages: Stages | None = None) -> Path:
    """The converted folder of packaged model ``name``: the cached one when intact, else built
    now (verified first). Not installed: ``PackagedModelError`` with the install command."""
    return ensure_model_folder(PACKAGED_MODELS.get(name), stages)


def ensure_model_folder(model: PackagedModel, stages: Stages | None = None) -> Path:
    """``ensure_folder`` of a ``PackagedModel`` (registered or not)."""
    digest = recorded_sha256(model, locate(model))
    return _ensure_at(model, digest, cache_folder(model, digest), stages)


def _converted_model(spec: str) -> tuple[Path, PackagedModel | None] | None:
    """A folder spec that is a converted packaged model (named as the cache names one, or
    holding a manifest): the folder and the model it is named for; else None."""
    folder = Path(spec).expanduser()
    model = named_for(folder)
    if model is None and not (folder / MANIFEST).is_file():
        return None
    return folder, model


def _restore_command(model: PackagedModel, folder: Path) -> str:
    env = "" if folder.parent == models_dir() else f"MUTUALRL_CACHE={folder.parent.parent} "
    return f"{env}mutualrl models fetch {model.name}"


def reverify_folder(spec: str, stages: Stages | None = None) -> None:
    """A converted folder named by path (a resumed run's config.json, a compare's runs) checked
    as a fresh run checks the cache: manifest hashes and source against the packaged model it is
    named for. Missing or damaged, it is converted again when the installed package makes that
    very folder, else a ``PackagedModelError`` names the command that restores it."""
    found = _converted_model(spec)
    if found is None:
        return
    folder, model = found
    if model is None:  # a copy outside the cache, by another name: it can only be checked
        if (problem := folder_problem(folder)) is not None:
            raise PackagedModelError(f"converted folder {folder}: {problem}; convert it again")
        remember(folder)
        return
    named = folder.name.removeprefix(f"{model.name}-")[:16]
    problem = folder_problem(folder, model, named) if folder.is_dir() else "missing"
    if problem is None:
        remember(folder)
        return
    try:
        digest: str | None = recorded_sha256(model, locate(model))
    except PackagedModelError:
        digest = None  # not installed (or damaged): the restore command installs it
    if digest is not None and cache_folder(model, digest).name == folder.name:
        if problem == "missing":
            _note(f"the converted folder {folder} is missing; converting it again")
        _ensure_at(model, digest, folder, stages)
        return
    what = "is missing" if problem == "missing" else f"is damaged ({problem})"
    other = "" if digest is None else " (the installed package is another version)"
    raise PackagedModelError(
        f"packaged model {model.name!r}: the converted folder {folder} {what}{other}; "
        f"restore it with: {_restore_command(model, folder)}"
    )


def verify_before_load(spec: str) -> None:
    """Raise ``PackagedModelError`` when ``spec`` is a converted folder that fails its manifest
    now: what a worker runs before it loads one (nothing is rebuilt here; the run's driver did
    that). A folder this process verified and that has not changed since is not hashed again."""
    found = _converted_model(spec)
    if found is None or unchanged_since_verified(found[0]):
        return
    folder, model = found
    named = "" if model is None else folder.name.removeprefix(f"{model.name}-")[:16]
    problem = folder_problem(folder, model, named) if folder.is_dir() else "missing"
    if problem is not None:
        restore = "convert it again" if model is None else _restore_command(model, folder)
        raise PackagedModelError(
            f"converted folder {folder}: {problem}; nothing was loaded; restore it with: {restore}"
        )
    remember(folder)


def resolve_checkpoint(spec: str | None, stages: Stages | None = None) -> str | None:
    """A checkpoint spec as a folder: a packaged name becomes its converted folder (built once);
    a converted folder by path is verified again (``reverify_folder``); anything else is
    returned unchanged."""
    if spec is None:
        return None
    if is_packaged_name(spec):
        return str(ensure_folder(spec, stages))
    reverify_folder(spec, stages)
    return spec


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
