"""Reading a run's JSON-lines record files, and finding damage in them before a resume writes.

``metrics.jsonl``, ``heldout.jsonl`` and ``failures.jsonl`` hold one JSON object per line, UTF-8.
A line that is not (a flipped byte, an edit, a torn write from outside the run) is a
``DamagedRecords`` error naming the file, the byte offset and the line, never a bare
``UnicodeDecodeError`` naming nothing. A resume appends to these files and reads them back at its
end, so ``check_records`` reads each one up to what the checkpoint recorded before any step runs:
damage is found in a second, not after the whole resumed run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NoReturn

from mutualrl.config import ConfigError

# Record files a resumed run appends to without a length in its checkpoint: read whole.
UNRECORDED = ("failures.jsonl",)


class DamagedRecords(ConfigError):
    """A record file holds a line that is not a UTF-8 JSON object."""


def read_jsonl(path: str | Path, upto: int | None = None) -> list[dict[str, Any]]:
    """Every record of the JSON-lines file ``path`` (its first ``upto`` bytes: None, all of it);
    blank lines are skipped. Raises ``DamagedRecords`` at the first line that is not a UTF-8 JSON
    object, or when ``upto`` falls inside a line."""
    path = Path(path)
    records: list[dict[str, Any]] = []
    offset = 0
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            if upto is not None and offset + len(raw) > upto:
                if offset < upto:
                    _damaged(
                        path,
                        offset,
                        number,
                        f"the line runs past byte {upto}, where the "
                        "file ended when it was recorded whole",
                    )
                break
            record = _parse(path, raw, offset, number)
            if record is not None:
                records.append(record)
            offset += len(raw)
    return records


def _parse(path: Path, raw: bytes, offset: int, number: int) -> dict[str, Any] | None:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        _damaged(path, offset + exc.start, number, f"not valid UTF-8 (byte 0x{raw[exc.start]:02x})")
    if not text.strip():
        return None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        _damaged(
            path, offset + len(text[: exc.pos].encode()), number, f"not valid JSON ({exc.msg})"
        )
    if not isinstance(record, dict):
        _damaged(path, offset, number, f"a JSON {type(record).__name__}, not an object")
    return record


def _damaged(path: Path, byte: int, number: int, why: str) -> NoReturn:
    raise DamagedRecords(
        f"{path}: byte {byte} (line {number}): {why}; expected one JSON object per line"
    )


def check_records(run_dir: str | Path, recorded: dict[str, int], checkpoint: str) -> None:
    """Before a resume writes anything: every record file it appends to must read whole, each
    up to the length ``recorded`` at the checkpoint (named ``checkpoint``), the others
    (``UNRECORDED``) entirely. The first damage is a ``DamagedRecords`` naming file and byte."""
    run_dir = Path(run_dir)
    files: list[tuple[Path, int | None]] = [(run_dir / n, size) for n, size in recorded.items()]
    files += [(run_dir / name, None) for name in UNRECORDED]
    for path, size in files:
        if not path.is_file():
            continue  # a missing file the checkpoint recorded is check_lengths' refusal
        try:
            read_jsonl(path, size)
        except DamagedRecords as exc:
            raise DamagedRecords(
                f"--resume: {exc} (checkpoint {checkpoint}); the run cannot "
                "continue on damaged records: restore the file, or start "
                "afresh with --overwrite"
            ) from None
