"""Bundled example specs: ``hwtopo.load("edge-home")`` or ``example_path("geo-3region")``."""

from __future__ import annotations

from pathlib import Path

__all__ = ["EXAMPLES", "example_path"]

_HERE = Path(__file__).parent
EXAMPLES = sorted(p.stem for p in _HERE.iterdir() if p.suffix in (".json", ".toml"))


def example_path(name: str) -> Path:
    """Path of a bundled example spec by name (without extension)."""
    for suffix in (".toml", ".json"):
        p = _HERE / f"{name}{suffix}"
        if p.exists():
            return p
    raise FileNotFoundError(f"no spec file or bundled example named {name!r}; examples are {EXAMPLES}")
