"""Real text for fine-tuning: a user file or the Python standard library's sources, as bytes.

Tokens are bytes (vocabulary 256), so no tokenizer has to be downloaded. Batches are a pure function
of (seed, step): a resumed run sees exactly the batches the uninterrupted run would have seen.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

__all__ = ["stdlib_corpus", "load_text", "ByteCorpus"]


def stdlib_corpus(max_bytes: int = 4_000_000) -> bytes:
    """Concatenated ``*.py`` sources of this Python's standard library (sorted, deterministic)."""
    root = Path(os.path.dirname(os.__file__))
    out, total = [], 0
    for path in sorted(root.glob("*.py")):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        out.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    text = b"\n".join(out)[:max_bytes]
    if len(text) < 10_000:
        raise RuntimeError(f"found only {len(text)} bytes of Python sources under {root}; pass a text file")
    return text


def load_text(path: str | os.PathLike | None, max_bytes: int = 4_000_000) -> bytes:
    """The bytes of ``path`` (a text file), or the standard-library corpus when None."""
    if path is None:
        return stdlib_corpus(max_bytes)
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"data: {p} is not a readable file; pass a text file or omit --data")
    data = p.read_bytes()[:max_bytes]
    if len(data) < 4096:
        raise ValueError(f"data: {p} has only {len(data)} bytes; need at least 4096 for training and evaluation")
    return data


class ByteCorpus:
    """Train/eval split (last 10% held out) and deterministic random windows of ``seq_len`` tokens.

    ``data``: bytes (each byte a token) or a tensor of token ids from a model's own tokenizer.
    """

    def __init__(self, data: bytes | torch.Tensor, seq_len: int, seed: int = 0):
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, not {seq_len}")
        if isinstance(data, torch.Tensor):
            tokens = data.long().reshape(-1)
        else:
            tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        cut = int(len(tokens) * 0.9)
        self.train, self.eval = tokens[:cut], tokens[cut:]
        if len(self.eval) <= seq_len or len(self.train) <= seq_len:
            raise ValueError(f"the text ({len(tokens)} tokens) is too short for seq_len {seq_len}")
        self.seq_len, self.seed = seq_len, seed

    def _windows(self, src: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        idx = starts[:, None] + torch.arange(self.seq_len)[None, :]
        return src[idx]

    def batch(self, step: int, batch_size: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.train) - self.seq_len, (batch_size,), generator=g)
        return self._windows(self.train, starts)

    def eval_batches(self, n: int, batch_size: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 - 1)
        return [
            self._windows(self.eval, torch.randint(0, len(self.eval) - self.seq_len, (batch_size,), generator=g))
            for _ in range(n)
        ]
