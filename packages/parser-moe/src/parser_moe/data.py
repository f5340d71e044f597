"""Real text without downloads: the Python standard library's own sources, as bytes (vocab 256).

Files are split by position in the sorted list, so training, calibration and evaluation text never
overlap: every 10th file is held out for evaluation, the 5th of every 10 for calibration.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

VOCAB_SIZE = 256


def stdlib_files() -> list[Path]:
    root = Path(os.path.dirname(os.__file__))
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    if len(files) < 20:
        raise RuntimeError(f"found only {len(files)} .py files under {root}; need the Python standard library sources")
    return files


def split_text(split: str, max_bytes: int | None = None) -> bytes:
    """Concatenated bytes of the files of ``split`` ('train', 'calib' or 'eval')."""
    if split not in ("train", "calib", "eval"):
        raise ValueError(f"split must be 'train', 'calib' or 'eval', got {split!r}")
    out = bytearray()
    for i, f in enumerate(stdlib_files()):
        r = i % 10
        which = "eval" if r == 0 else "calib" if r == 5 else "train"
        if which != split:
            continue
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
