"""A converted model folder's manifest: written last, checked before every load.

``write_manifest`` records every file's size and sha256 and what the folder was made from (the
packaged model, its GGUF file and that file's sha256); its presence marks a whole folder.
``folder_problem`` says why a folder is not that (partial, a file changed, another model's
folder under this one's name). ``remember`` and ``unchanged_since_verified`` let a worker in the
process that verified a folder load it without hashing it again, while any change to a file
(its size, mtime or ctime, which cannot be set back) makes it be checked afresh.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from mutualrl.policies.packaged import CONVERSION_VERSION, MANIFEST, PackagedModel


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


def source_of(model: PackagedModel, digest: str) -> dict:
    """What a converted folder's manifest records it was made from."""
    return {
        "model": model.name,
        "gguf": model.gguf_name,
        "sha256": digest,
        "requirements": list(model.requirements),
    }


def _source_problem(manifest: dict, model: PackagedModel, digest: str) -> str | None:
    """Why the manifest's source is not ``model``'s GGUF file whose sha256 starts with
    ``digest`` (a folder's name holds its first 16 hex digits)."""
    if manifest.get("version") != CONVERSION_VERSION:
        return (
            f"its manifest is of conversion version {manifest.get('version')!r}, "
            f"expected {CONVERSION_VERSION}"
        )
    source = manifest.get("source") or {}
    if source.get("model") != model.name or source.get("gguf") != model.gguf_name:
        return (
            f"its manifest's source is {source.get('model')!r} ({source.get('gguf')}), "
            f"not {model.name!r} ({model.gguf_name})"
        )
    if not str(source.get("sha256", "")).startswith(digest):
        return f"its manifest's source has sha256 {source.get('sha256')}, expected {digest}..."
    return None


def folder_problem(
    folder: Path, model: PackagedModel | None = None, digest: str = ""
) -> str | None:
    """Why ``folder`` is not a complete, intact converted model (None: it is). ``model``: the
    packaged model it must have been made from (and ``digest``, the start of its GGUF file's
    sha256): a whole, intact folder of another model under its name is not it."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        recorded = manifest["files"]
    except FileNotFoundError:
        return "no manifest (a partial conversion)"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"unreadable manifest ({exc})"
    if model is not None and (problem := _source_problem(manifest, model, digest)):
        return problem
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


# Converted folders verified in this process, with their files' stat signature then.
_verified: dict[Path, tuple] = {}


def _signature(folder: Path) -> tuple:
    stats = ((p, p.stat()) for p in sorted(folder.rglob("*")) if p.is_file())
    return tuple((str(p), s.st_size, s.st_mtime_ns, s.st_ctime_ns) for p, s in stats)


def remember(folder: Path) -> None:
    """``folder`` was just verified in this process."""
    _verified[folder.absolute()] = _signature(folder)


def unchanged_since_verified(folder: Path) -> bool:
    """``folder`` was verified in this process and no file of it changed since."""
    return folder.is_dir() and _verified.get(folder.absolute()) == _signature(folder)
