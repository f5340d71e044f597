"""Tiny transformers causal LMs built locally and real text (Python's own stdlib sources, as bytes)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = ["tiny_llama_config", "build_model", "model_skeleton", "stdlib_tokens", "TextData"]


def tiny_llama_config(
    layers: int = 4,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 192,
    vocab: int = 256,
    max_positions: int = 512,
):
    """A LlamaConfig small enough for CPU runs (byte-level vocabulary, SDPA causal attention)."""
    from transformers import LlamaConfig

    if hidden % heads:
        raise ValueError(f"hidden={hidden} must be divisible by heads={heads}")
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
    )
    cfg._attn_implementation = "sdpa"  # with no mask SDPA is causal; eager would not be
    return cfg


def build_model(config, seed: int = 0):
    """A freshly initialised LlamaForCausalLM (fp32, same weights for the same seed on every rank)."""
    torch.manual_seed(seed)
    return _llama(config)


def model_skeleton(config):
    """LlamaForCausalLM's module tree on the meta device, weights uninitialised (an executor puts its shards in;
    initialising them was most of the cost of building an executor)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # an early transformers 5 without it: the same tree, initialised
        from contextlib import nullcontext as no_init_weights
    with torch.device("meta"), no_init_weights():
        return _llama(config)


def _llama(config):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(config).float()
    model.config._attn_implementation = "sdpa"
    return model


def stdlib_tokens(max_bytes: int = 2_000_000) -> np.ndarray:
    """Bytes of the standard library's top-level .py files (sorted, so the corpus is reproducible)."""
    root = Path(os.path.dirname(os.__file__))
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total < 10_000:
        raise RuntimeError(f"found only {total} bytes of Python sources under {root}")
    return np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)


@dataclass
class TextData:
    """A deterministic training stream, validation windows and an optional held-out split over a token array.

    Sample i depends only on (seed, i): every strategy and rank sees the same samples in the same order. The last
    ``held_out_tokens`` tokens are neither trained nor measured on; training and validation split the rest."""

    tokens: np.ndarray
    seq_len: int
    seed: int = 0
    val_fraction: float = 0.1
    held_out_tokens: int = 0

    def __post_init__(self) -> None:
        n = len(self.tokens) - self.held_out_tokens
        if self.held_out_tokens and not 2 * self.seq_len < self.held_out_tokens < len(self.tokens):
            raise ValueError(
                f"held_out_tokens must be above 2 x seq_len ({2 * self.seq_len}) and under the "
                f"{len(self.tokens)} tokens, got {self.held_out_tokens}"
            )
        self._end = n  # validation ends here, the held-out split starts here
        self._split = int(n * (1 - self.val_fraction))
        if self._split <= self.seq_len * 2 or n - self._split <= self.seq_len * 2:
            raise ValueError(f"{n} tokens are too few for seq_len={self.seq_len}")
        rng = np.random.default_rng(self.seed)
        self._perm = rng.integers(0, self._split - self.seq_len, size=1 << 18)

    def samples(self, start: int, count: int) -> torch.Tensor:
        """Training samples start..start+count as a LongTensor [count, seq_len]."""
        idx = self._perm[np.arange(start, start + count) % len(self._perm)]
        rows = np.stack([self.tokens[i : i + self.seq_len] for i in idx])
        return torch.from_numpy(rows.astype(np.int64))

    def validation(self, count: int) -> torch.Tensor:
        """``count`` evenly spaced validation windows [count, seq_len]."""
        return self._windows(np.linspace(self._split, self._end - self.seq_len, count))

    def held_out(self, count: int) -> torch.Tensor:
        """``count`` evenly spaced windows of the held-out split (other text than training and validation)."""
        if not self.held_out_tokens:
            raise ValueError("this TextData has no held-out split (held_out_tokens=0)")
        return self._windows(np.linspace(self._end, len(self.tokens) - self.seq_len, count))

    def _windows(self, idx: np.ndarray) -> torch.Tensor:
        rows = np.stack([self.tokens[i : i + self.seq_len] for i in idx.astype(np.int64)])
        return torch.from_numpy(rows.astype(np.int64))
