"""The profiler's versioned dataset: JSON lines, a header line first, written atomically.

    {"format": "sysprdict-profile", "version": 1, "created": "...", "machine": {...}}
    {"model": "llama-s", "family": "llama", ..., "step_time_s": 0.012, "peak_bytes": 2814108}
    ...

A corrupt file fails with the file name and line number of the first bad line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import hwtopo

__all__ = ["FORMAT", "REQUIRED", "VERSION", "DatasetError", "load_rows", "save_rows"]

FORMAT = "sysprdict-profile"
VERSION = 1
REQUIRED: dict[str, type | tuple[type, ...]] = {
    "model": str,
    "family": str,
    "modality": str,
    "batch": int,
    "seq_len": int,
    "image_size": int,
    "precision": str,
    "optimizer": str,
    "checkpointing": bool,
    "world_size": int,
    "step_time_s": (int, float),
    "peak_bytes": int,
}


class DatasetError(ValueError):
    """A dataset file that cannot be read; the message names the file and line."""


def _check_row(row: object, where: str) -> dict:
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for key, typ in REQUIRED.items():
        if key not in row:
            raise DatasetError(f"{where}: missing field {key!r}")
        val = row[key]
        if not isinstance(val, typ) or (typ is int and isinstance(val, bool)):
            raise DatasetError(f"{where}: field {key!r} has {val!r}; expected {getattr(typ, '__name__', 'a number')}")
    if not row["step_time_s"] > 0:
        raise DatasetError(f"{where}: field 'step_time_s' must be > 0, got {row['step_time_s']!r}")
    return row


def save_rows(path: str | os.PathLike, rows: list[dict], meta: dict | None = None) -> Path:
    """Write `rows` (each checked) under a versioned header, atomically (temp file + os.replace)."""
    path = Path(path)
    header = {"format": FORMAT, "version": VERSION, **(meta or {})}
    lines = [json.dumps(header, sort_keys=True)]
    for i, r in enumerate(rows):
        _check_row(r, f"{path}: row {i}")
        lines.append(json.dumps(r, sort_keys=True))
    path.parent.mkdir(parents=True, exist_ok=True)
    hwtopo.atomic_write_text(path, "\n".join(lines) + "\n")
    return path


def load_rows(path: str | os.PathLike) -> tuple[dict, list[dict]]:
    """(header, rows) of a dataset file; DatasetError naming file:line on the first bad line."""
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"{path}: no such dataset file; create one with `sysprdict profile --out {path}`")
    header: dict | None = None
    rows: list[dict] = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise DatasetError(f"{path}: not UTF-8 text; a dataset is JSON lines from `sysprdict profile`") from None
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{where}: not valid JSON ({e.msg})") from None
        if header is None:
            if not isinstance(obj, dict) or obj.get("format") != FORMAT:
                raise DatasetError(f"{where}: missing header line with format {FORMAT!r}")
            if obj.get("version") != VERSION:
                raise DatasetError(f"{where}: dataset version {obj.get('version')!r} is not supported (need {VERSION})")
            header = obj
            continue
        rows.append(_check_row(obj, where))
    if header is None:
        raise DatasetError(f"{path}:1: empty dataset file (no header line)")
    return header, rows
