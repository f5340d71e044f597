"""Real text without downloads: the Python standard library's own sources, as bytes (vocab 256).

Files are split by position in the sorted list, so no file is in two splits: the 5th of every 10
files is calibration text, the 0th of every 10 is evaluation text, everything else trains the tiny
MoE. Evaluation files alternate between a development split (``dev``: settings of the variants are
chosen there) and a held-out split (``test``: what the bench reports); ``eval`` is both together.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

VOCAB_SIZE = 256
SPLITS = ("train", "calib", "eval", "dev", "test")


def stdlib_files() -> list[Path]:
    root = Path(os.path.dirname(os.__file__))
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    if len(files) < 20:
        raise RuntimeError(f"found only {len(files)} .py files under {root}; need the Python standard library sources")
    return files


def _split_of(i: int) -> str:
    r = i % 20
    if r == 0:
        return "dev"
    if r == 10:
        return "test"
    return "calib" if r % 10 == 5 else "train"


def split_files(split: str) -> list[Path]:
    """The standard-library files of ``split``; no file belongs to two of train, calib, dev, test."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}; got {split!r}")
    want = ("dev", "test") if split == "eval" else (split,)
    return [f for i, f in enumerate(stdlib_files()) if _split_of(i) in want]


def split_text(split: str, max_bytes: int | None = None) -> bytes:
    """Concatenated bytes of the files of ``split`` (one of :data:`SPLITS`)."""
    out = bytearray()
    for f in split_files(split):
        out += f.read_bytes() + b"\n"
        if max_bytes is not None and len(out) >= max_bytes:
            break
    return bytes(out[:max_bytes] if max_bytes is not None else out)


def encode(text: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def sequences(split: str, n: int, seq_len: int, seed: int | None = None, tokenizer=None) -> torch.Tensor:
    """``n`` sequences [n, seq_len] of tokens: contiguous chunks (seed None) or random windows.

    Tokens are bytes, or the ids of ``tokenizer`` (a transformers tokenizer) when one is given.
    """
    need = n * seq_len if seed is None else None
    if tokenizer is None:
        ids = encode(split_text(split, max_bytes=need))
    else:
        text = split_text(split, max_bytes=None if need is None else need * 8).decode("utf-8", "replace")
        ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    if ids.numel() < seq_len + 1:
        raise ValueError(f"split {split!r} has only {ids.numel()} tokens; seq_len={seq_len} is too long")
    if seed is None:
        k = min(n, ids.numel() // seq_len)
        return ids[: k * seq_len].view(k, seq_len)
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - seq_len, (n,), generator=g)
    return torch.stack([ids[s : s + seq_len] for s in starts.tolist()])
